"""auto's timing: medians after a warm-up, the fastest passing backend, its speedup."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_speedkit.attention._auto_timing import median_seconds, pick_fastest
from lightning_speedkit.attention._parity import Run


class _Clock:
    """A fake clock: each run advances it by what that run costs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(clock: _Clock, seconds: float, module: nn.Module) -> Run:
    def forward() -> torch.Tensor:
        clock.now += seconds
        return torch.ones(1)

    return Run(forward, ((), {}), module, grad=False)


def test_median_drops_the_warm_up_and_takes_the_middle_time() -> None:
    reads = iter([0.0, 10.0, 12.0, 20.0, 23.0, 30.0, 34.0])  # warm-up, then 2, 3, 4 s
    calls = []
    run = Run(lambda: calls.append(1) or torch.ones(1), ((), {}), nn.Identity(), grad=False)
    assert median_seconds(run, clock=lambda: next(reads)) == 3.0
    assert len(calls) == 5  # the check's own forward, one warm-up, three timed


def test_the_fastest_passing_backend_is_kept_with_its_speedup() -> None:
    clock, module = _Clock(), nn.Identity()
    own = _run(clock, 0.006, module)
    passing = [
        ("sdpa", 1e-6, _run(clock, 0.003, module)),
        ("flash", 2e-6, _run(clock, 0.002, module)),
    ]
    backend, error, speedup = pick_fastest(own, passing, clock=clock)
    assert (backend, error) == ("flash", 2e-6)
    assert speedup == pytest.approx(3.0, rel=1e-9)


def test_ties_go_to_the_first_by_name_and_no_time_gives_no_speedup() -> None:
    clock, module = _Clock(), nn.Identity()
    own = _run(clock, 0.001, module)
    passing = [("sdpa", 0.0, _run(clock, 0.0, module)), ("math", 0.0, _run(clock, 0.0, module))]
    assert pick_fastest(own, passing, clock=clock) == ("math", 0.0, None)
