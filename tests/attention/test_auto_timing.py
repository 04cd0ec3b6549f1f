"""auto's timing: medians of runs timed in turns, the backend kept, its speedup."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_speedkit.attention._auto_timing import interleaved_medians, pick_fastest
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


def test_runs_are_timed_in_turns_after_a_warm_up_each() -> None:
    clock, order = _Clock(), []

    def run(name: str, seconds: float) -> Run:
        def forward() -> torch.Tensor:
            order.append(name)
            clock.now += seconds
            return torch.ones(1)

        return Run(forward, ((), {}), nn.Identity(), grad=False)

    a, b = run("a", 0.004), run("b", 0.002)
    order.clear()  # Run calls each once when made
    assert interleaved_medians([a, b], clock=clock) == pytest.approx([0.004, 0.002])
    # a warm-up round, then rounds until each has 10 ms timed: b needs 5 rounds
    assert order == ["a", "b"] * 6


def test_a_busy_spell_on_one_round_moves_no_median() -> None:
    clock, module = _Clock(), nn.Identity()
    spells = iter([0.0, 0.0, 0.05, 0.0] + [0.0] * 100)  # round 1 of `a`: 50 ms of other work

    def busy(seconds: float) -> Run:
        def forward() -> torch.Tensor:
            clock.now += seconds + next(spells)
            return torch.ones(1)

        return Run(forward, ((), {}), module, grad=False)

    runs = [busy(0.004), busy(0.004)]
    assert interleaved_medians(runs, clock=clock) == pytest.approx([0.004, 0.004])


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


def test_ties_go_to_the_first_candidate_and_no_time_gives_no_speedup() -> None:
    clock, module = _Clock(), nn.Identity()
    own = _run(clock, 0.001, module)
    passing = [("sdpa", 0.0, _run(clock, 0.0, module)), ("math", 0.0, _run(clock, 0.0, module))]
    assert pick_fastest(own, passing, clock=clock) == ("sdpa", 0.0, None)


@pytest.mark.parametrize(("flash", "kept"), [(0.0028, "sdpa"), (0.0026, "flash")])
def test_a_later_backend_replaces_the_first_only_when_clearly_faster(
    flash: float, kept: str
) -> None:
    """Within 10% of sdpa's time is noise: picking by it gave seeded runs other backends,
    and other last bits, from one run to the next."""
    clock, module = _Clock(), nn.Identity()
    own = _run(clock, 0.006, module)
    passing = [
        ("sdpa", 1e-6, _run(clock, 0.003, module)),
        ("flash", 2e-6, _run(clock, flash, module)),
        ("math", 3e-6, _run(clock, 0.0029, module)),
    ]
    backend, _, speedup = pick_fastest(own, passing, clock=clock)
    assert backend == kept
    assert speedup == pytest.approx(0.006 / (0.003 if kept == "sdpa" else flash))
