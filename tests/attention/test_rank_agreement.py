"""The ranks' agreement, driven by a fake all-gather: every rank runs rank 0's decisions."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_speedkit import swap_attention
from lightning_speedkit._surgery import replaced_forward
from lightning_speedkit.attention._rank_agreement import agree, decision
from lightning_speedkit.attention.swap import SwapReport, swapped_modules


def _swapped() -> tuple[nn.Module, SwapReport]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, batch_first=True)
    report = swap_attention(layer, "sdpa", sample=torch.randn(2, 5, 16), measure=False)
    assert report.modules[0].status == "active"
    return layer, report


def _gather(rank_0: dict[str, Any] | None, rank_1: dict[str, Any] | None) -> Any:
    """An all-gather whose other rank decided ``rank_0`` / ``rank_1``; this rank gives its own."""

    def all_gather(out: list[Any], mine: dict[str, Any]) -> None:
        out[0] = mine if rank_0 is None else rank_0
        out[1] = mine if rank_1 is None else rank_1

    return all_gather


def test_a_decision_is_plain_values() -> None:
    _, report = _swapped()
    entry = report.modules[0]
    assert decision(entry) == {
        "status": "active",
        "backend": entry.backend,
        "reason": "",
        "packed_backend": None,
        "parity_error": entry.parity_error,
        "speedup": None,
        "checked": "forward+backward",
    }


def test_another_rank_takes_rank_0s_revert() -> None:
    layer, report = _swapped()
    rank_0 = {"self_attn": {"status": "reverted", "reason": "parity error 1.0e+00"}}
    with pytest.warns(UserWarning, match="kept 'self_attn'"):
        agree(report, rank=1, world_size=2, all_gather=_gather(rank_0, None))
    entry = report.modules[0]
    assert (entry.status, entry.reason) == ("reverted", "reverted on rank 0: parity error 1.0e+00")
    assert replaced_forward(layer.self_attn) is None  # its own forward runs


def test_another_rank_takes_rank_0s_own_forward_kept_for_all_but_packed_batches() -> None:
    # auto kept the own forward on rank 0 (timed faster), where rank 1 swapped: rank 1 runs
    # its own forward too, and rank 0's checked backend for packed batches, as rank 0 does.
    layer, report = _swapped()
    rank_0 = {
        "self_attn": {
            "status": "reverted",
            "reason": "own forward faster",
            "packed_backend": "math",
        }
    }
    with pytest.warns(UserWarning, match="packed batches still run 'math'"):
        agree(report, rank=1, world_size=2, all_gather=_gather(rank_0, None))
    entry = report.modules[0]
    assert (entry.status, entry.packed_backend) == ("reverted", "math")
    swap = swapped_modules(layer)["self_attn"]
    assert swap.packed_only
    assert swap.ctx.attend.backend == "math"
    rank_0["self_attn"] = {"status": "reverted", "reason": "parity error 1.0e+00"}
    with pytest.warns(UserWarning, match="parity error"):  # now a plain revert: nothing kept
        agree(report, rank=1, world_size=2, all_gather=_gather(rank_0, None))
    assert replaced_forward(layer.self_attn) is None
    assert (entry.status, entry.packed_backend) == ("reverted", None)


def test_another_rank_takes_rank_0s_backend_and_its_checks() -> None:
    layer, report = _swapped()
    rank_0 = {
        "self_attn": {
            "status": "active",
            "backend": "math",
            "reason": "",
            "parity_error": 1e-7,
            "speedup": 1.5,
            "checked": "forward",
        }
    }
    agree(report, rank=1, world_size=2, all_gather=_gather(rank_0, None))
    entry = report.modules[0]
    assert (entry.backend, entry.parity_error, entry.speedup) == ("math", 1e-7, 1.5)
    swap = swapped_modules(layer)["self_attn"]
    assert swap.ctx.attend.backend == "math"
    assert (swap.checked_forward, swap.checked_backward) == (True, False)  # rank 0's checks


def test_rank_0_keeps_its_decisions_and_notes_what_the_others_decided() -> None:
    _, report = _swapped()
    rank_1 = {"self_attn": {"status": "reverted", "reason": "too far"}}
    with pytest.warns(UserWarning, match=r"self_attn: rank 1 reverted it \(too far\)\.$"):
        agree(report, rank=0, world_size=2, all_gather=_gather(None, rank_1))
    entry = report.modules[0]
    assert (entry.status, entry.ranks) == ("active", "rank 1 reverted it (too far)")
    assert "rank 1 reverted it (too far)" in report.to_markdown()


def test_ranks_that_agree_change_nothing() -> None:
    _, report = _swapped()
    before = decision(report.modules[0])
    agree(report, rank=1, world_size=2, all_gather=_gather(None, None))
    assert decision(report.modules[0]) == before
    assert report.modules[0].ranks == ""
