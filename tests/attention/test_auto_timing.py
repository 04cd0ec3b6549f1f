"""auto's timing: medians of runs timed in turns, the backend kept, its speedup."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_speedkit.attention._auto_timing import interleaved_times, pick_fastest
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

    a, b = run("a", 0.004), run("b", 0.0015)
    order.clear()  # Run calls each once when made
    times = interleaved_times([a, b], clock=clock)
    # a warm-up round, then rounds until each has 10 ms timed: b needs 7 rounds
    assert order == ["a", "b"] * 8
    assert times == [pytest.approx([0.004] * 7), pytest.approx([0.0015] * 7)]


def test_a_busy_spell_on_one_backends_runs_moves_no_pick() -> None:
    """Load that falls on one backend's run of a round (another process woke up) is one
    paired ratio of five: the median leaves it out."""
    clock, module = _Clock(), nn.Identity()
    spells = {("flash", 1): 0.05, ("flash", 3): 0.05}  # two of flash's rounds ran under load
    calls = {"own": 0, "sdpa": 0, "flash": 0}

    def busy(name: str, seconds: float) -> Run:
        def forward() -> torch.Tensor:
            clock.now += seconds + spells.get((name, calls[name]), 0.0)
            calls[name] += 1
            return torch.ones(1)

        return Run(forward, ((), {}), module, grad=False)

    own, sdpa, flash = busy("own", 0.006), busy("sdpa", 0.003), busy("flash", 0.002)
    backend, _, speedup = pick_fastest(
        own, [("sdpa", 0.0, sdpa), ("flash", 0.0, flash)], clock=clock
    )
    assert backend == "flash"
    assert speedup == pytest.approx(3.0)


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
