"""Which kernel a group added after the switch may take, decided without a Trainer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_speedkit.compute._fused_choice import (
    added_group_refusal,
    choose,
    sparse_gradient_parameters,
)


def _adamw() -> torch.optim.AdamW:
    return torch.optim.AdamW([nn.Parameter(torch.ones(4))], lr=0.01)


def _group(**options: Any) -> dict[str, Any]:
    return {"params": [nn.Parameter(torch.ones(4))], "lr": 0.01, "betas": (0.9, 0.999),
            "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False, **options}  # fmt: skip


def test_an_added_group_refuses_with_the_reason_and_whether_to_warn() -> None:
    optimizer = _adamw()
    refuse = added_group_refusal
    assert refuse(optimizer, _group(fused=True), "fused", None) == (
        "`fused=True` already, as added", False)  # fmt: skip
    assert refuse(optimizer, _group(foreach=False), "fused", None) == (
        "`foreach=False` was set explicitly: left as chosen", False)  # fmt: skip
    assert refuse(optimizer, _group(foreach=True), "fused", None) == (
        "`foreach=True` was set explicitly: left as chosen", False)  # fmt: skip
    assert refuse(optimizer, {"params": []}, "fused", None) == ("it holds no parameters", False)
    assert refuse(optimizer, _group(differentiable=True), "fused", None) == (
        "differentiable=True: torch has no fused or foreach kernel for that", True)  # fmt: skip
    assert refuse(optimizer, _group(), "fused", None) is None  # the probe agrees


def test_an_added_group_of_a_sparse_embedding_is_named_from_the_model() -> None:
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    assert sparse_gradient_parameters(model) == {
        id(model[0].weight): "`0` (Embedding with sparse=True)"
    }
    group = {"params": [model[0].weight], "lr": 0.01}
    assert added_group_refusal(_adamw(), group, "fused", model) == (
        "its parameters get sparse gradients from `0` (Embedding with sparse=True), which the "
        "kernel refuses",
        True,
    )
    assert sparse_gradient_parameters(None) == {}


def test_the_choice_for_a_whole_optimizer() -> None:
    assert choose(_adamw(), {}) == ("fused", "torch's fused AdamW kernel on cpu")
    lbfgs = torch.optim.LBFGS([nn.Parameter(torch.ones(2))])
    assert choose(lbfgs, {}) == (None, "torch has no fused LBFGS, nor a foreach one")
    chosen = torch.optim.AdamW([nn.Parameter(torch.ones(2))], foreach=False)
    assert choose(chosen, {}) == (None, "`foreach=False` was set explicitly: left as chosen")
