"""A switch kept on the optimizer: flags set, checkpoints written as the unswitched one's."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from lightning_speedkit.compute._fused_switch import (
    MARK,
    Switch,
    apply_flags,
    describe,
    group_flags,
    install_hooks,
)


def _switched() -> tuple[nn.Module, torch.optim.AdamW, Switch]:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    record = Switch("fused", [group_flags(g) for g in optimizer.param_groups], 1,
                    model=weakref.ref(model))  # fmt: skip
    install_hooks(optimizer, record)
    apply_flags(optimizer, "fused", record.switched())
    return model, optimizer, record


def test_the_flags_are_set_and_the_saved_groups_keep_the_original_ones() -> None:
    _model, optimizer, record = _switched()  # the model lives while the record names it
    assert getattr(optimizer, MARK) is record
    assert record.original == [{"fused": None, "foreach": None}]
    assert (optimizer.param_groups[0]["fused"], optimizer.param_groups[0]["foreach"]) == (
        True, False)  # fmt: skip
    saved = optimizer.state_dict()["param_groups"][0]
    assert (saved["fused"], saved["foreach"]) == (None, None)
    optimizer.load_state_dict(optimizer.state_dict())  # a resume: switched again
    assert optimizer.param_groups[0]["fused"] is True


def test_a_group_is_described_by_its_parameters_names() -> None:
    _model, optimizer, record = _switched()  # the model lives while the record names it
    assert describe(0, optimizer.param_groups[0], record) == "group 0 (2 parameters: weight, bias)"
    lone = {"params": [nn.Parameter(torch.ones(1))]}
    assert describe(1, lone, record) == "group 1 (1 parameter)"  # not the model's: unnamed


def test_a_group_added_later_takes_the_flag_before_its_first_step() -> None:
    _model, optimizer, record = _switched()  # the model lives while the record names it
    extra = nn.Parameter(torch.ones(4))
    optimizer.add_param_group({"params": [extra]})
    extra.grad = torch.ones(4)
    optimizer.step()
    assert optimizer.param_groups[1]["fused"] is True
    assert record.switched() == [0, 1]
    assert len(record.original) == 2
