"""A reverted module's report row reads as one verdict: the backend judged and its error."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import Tensor

from lightning_speedkit import swap_attention
from lightning_speedkit.attention.backends import auto_candidates

from .test_swap import HeadMixingAttention


def _reported_error(reason: str) -> tuple[float, str]:
    found = re.match(
        r"parity error (\S+) > tolerance \S+ on \S+ inputs with backend '(\w+)'", reason
    )
    assert found, reason
    return float(found[1]), found[2]


def test_auto_reports_the_closest_backend_and_names_every_one_tried() -> None:
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="parity error"):
        report = swap_attention(HeadMixingAttention(), "auto", sample=x)
    entry = report.modules[0]
    assert entry.status == "reverted"
    error, backend = _reported_error(entry.reason)
    assert entry.backend is not None
    assert entry.backend.split(" ")[0] == backend  # the column names the backend judged
    assert entry.parity_error == pytest.approx(error, rel=1e-2)  # and shows its failing error
    tried = auto_candidates(torch.device("cpu"))
    others = [b for b in tried if b != backend]
    assert others  # the note names the others, with their errors
    for other in others:
        assert re.search(rf"'{other}' \(parity error \S+\)", entry.reason), entry.reason
    row = next(line for line in str(report).splitlines() if line.startswith("| (root)"))
    assert f"| {entry.backend} | reverted | {entry.parity_error:.1e} |" in row


class LateOff(HeadMixingAttention):
    """Attention on the synthetic check's batch of 2; on bigger batches something else."""

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = (
            p(x).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        weights = (q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)).softmax(-1)
        if B > 2:
            weights = weights.mean(dim=1, keepdim=True).expand_as(weights)  # heads mixed
        return self.o_proj((weights @ v).transpose(1, 2).reshape(B, N, C))


def test_a_revert_after_a_passed_check_shows_the_failing_error_not_the_passed_one() -> None:
    module = LateOff()
    report = swap_attention(module, "sdpa")  # the synthetic check (batch of 2) passes
    entry = report.modules[0]
    assert entry.checked == "synthetic"
    assert entry.parity_error is not None
    assert entry.parity_error < 1e-4
    with pytest.warns(UserWarning, match="parity error"):
        module(torch.randn(3, 6, 32))
    assert entry.status == "reverted"
    error, backend = _reported_error(entry.reason)
    assert backend == "sdpa"
    assert entry.parity_error == pytest.approx(error, rel=1e-2)
    assert entry.parity_error > 1e-4
