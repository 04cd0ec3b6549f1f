"""ProfilerCycle: torch's schedule as a pure function of the step, shifted and predicted."""

from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerAction

from lightning_speedkit import SpeedkitConfigError
from lightning_speedkit.measure._profiler_cycle import ProfilerCycle

NONE, WARMUP, RECORD, SAVE = (ProfilerAction.NONE, ProfilerAction.WARMUP,
                              ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)  # fmt: skip


def test_the_actions_are_torchs_for_every_step() -> None:
    cycle = ProfilerCycle(skip_first=2, wait=1, warmup=1, active=2, repeat=2)
    torchs = torch.profiler.schedule(skip_first=2, wait=1, warmup=1, active=2, repeat=2)
    assert [cycle.action(s) for s in range(14)] == [torchs(s) for s in range(14)]
    expected = [NONE, NONE, NONE, WARMUP, RECORD, SAVE, NONE, WARMUP, RECORD, SAVE, NONE, NONE]
    assert [cycle.action(s) for s in range(12)] == expected


def test_a_delay_shifts_the_whole_schedule() -> None:
    cycle = ProfilerCycle(skip_first=0, wait=0, warmup=1, active=2, repeat=1)
    assert [cycle.action(s, delay=2) for s in range(6)] == [NONE, NONE, WARMUP, RECORD, SAVE, NONE]
    assert cycle.next_window(0, delay=2) == 2


@pytest.mark.parametrize(
    ("step", "delay", "expected"),
    [(0, 0, 3), (3, 0, 3), (4, 0, 4), (6, 0, 7), (8, 0, 8), (10, 0, math.inf), (0, 5, 8)],
)
def test_the_next_window_by_arithmetic(step: int, delay: int, expected: float) -> None:
    # skip 2, then cycles of 1 idle + 1 warm-up + 2 recorded, twice: busy at 3-5 and 7-9
    cycle = ProfilerCycle(skip_first=2, wait=1, warmup=1, active=2, repeat=2)
    assert cycle.next_window(step, delay) == expected


def test_a_window_a_billion_steps_away_is_found_at_once() -> None:
    cycle = ProfilerCycle(skip_first=10**9, wait=5, warmup=1, active=3, repeat=1)
    assert cycle.next_window(0) == 10**9 + 5
    assert cycle.steps_to_save(0) == 10**9 + 9


def test_the_steps_to_the_next_save_count_from_the_current_cycle() -> None:
    cycle = ProfilerCycle(skip_first=3, wait=2, warmup=1, active=2, repeat=0)
    assert cycle.length == 5
    assert [cycle.steps_to_save(start) for start in (0, 3, 7, 8, 10)] == [8, 5, 1, 5, 3]


def test_nothing_recorded_gives_the_arithmetic() -> None:
    cycle = ProfilerCycle(skip_first=10, wait=1, warmup=1, active=3, repeat=1)
    message = cycle.nothing_recorded(ran=8, start_step=0, held=0, start_delay=0)
    assert message == (
        "ProfilerSchedule recorded nothing: training ran 8 steps, and its first window "
        "needed skip_first + wait + warmup + active = 10 + 1 + 1 + 3 = 15 steps. Lower "
        "`skip_first` or `wait`, or train longer."
    )
    held = cycle.nothing_recorded(ran=2, start_step=0, held=2, start_delay=0)
    assert "= 10 + 1 + 1 + 3 + 2 held while torch.compile compiled = 17 steps" in held
    resumed = cycle.nothing_recorded(ran=4, start_step=6, held=1, start_delay=1)
    assert "needed 11 more, resuming at step 6 steps" in resumed  # 15 - (6 - 1) + 1


@pytest.mark.parametrize("field", ["skip_first", "wait", "warmup", "active", "repeat"])
def test_a_negative_argument_is_refused_by_name(field: str) -> None:
    kwargs = {"skip_first": 0, "wait": 0, "warmup": 0, "active": 1, "repeat": 0, field: -1}
    with pytest.raises(SpeedkitConfigError, match=f"`{field}`"):
        ProfilerCycle(**kwargs)
