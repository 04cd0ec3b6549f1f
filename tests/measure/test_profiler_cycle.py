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


def test_nothing_recorded_gives_the_arithmetic_in_batches() -> None:
    cycle = ProfilerCycle(skip_first=10, wait=1, warmup=1, active=3, repeat=1)
    message = cycle.nothing_recorded(ran=8, start_step=0, held=0, start_delay=0)
    assert message == (
        "ProfilerSchedule recorded nothing: training ran 8 batches, and its first window "
        "needed skip_first + wait + warmup + active = 10 + 1 + 1 + 3 = 15 batches. Lower "
        "`skip_first` or `wait`, or train longer."
    )
    held = cycle.nothing_recorded(ran=2, start_step=0, held=2, start_delay=0)
    assert "= 10 + 1 + 1 + 3 + 2 held while torch.compile compiled = 17 batches." in held


def test_a_resumed_run_is_told_the_batches_its_next_window_needed_from_the_resume() -> None:
    cycle = ProfilerCycle(skip_first=10, wait=1, warmup=1, active=3, repeat=1)
    # resumed at batch 6, 1 of them held: position 5, the window saves at position 14
    resumed = cycle.nothing_recorded(ran=4, start_step=6, held=1, start_delay=1)
    assert resumed == (
        "ProfilerSchedule recorded nothing: this run resumed after 6 batches and trained 4 "
        "more, and its next window needed 11 (10 + 1 held while torch.compile compiled) "
        "from there. Train at least 11 batches after resuming, or lower `skip_first` or "
        "`wait` (a resumed run counts batches from the start of training)."
    )
    plain = cycle.nothing_recorded(ran=4, start_step=6, held=0, start_delay=0)
    assert "and its next window needed 9 from there. Train at least 9 batches" in plain
    assert [cycle.action(s) for s in (14, 15)] == [SAVE, NONE]  # 6 + 9 = 15 batches


def records_in(cycle: ProfilerCycle, first: int, end: int) -> bool:
    """Whether a whole window (warm-up to save) lies in batches ``first`` to ``end - 1``."""
    start = cycle.next_window(first)
    return start < end and start + cycle.steps_to_save(int(start)) <= end


def test_windows_all_behind_the_resume_point_are_said_with_fixes_that_work() -> None:
    # The probe: fit with skip_first=2, wait=1, active=2 to batch 24, resume with this
    # schedule to batch 36. Its 3 cycles end at batch 9, long before the resume.
    cycle = ProfilerCycle(skip_first=0, wait=1, warmup=1, active=1, repeat=3)
    assert cycle.next_window(24) == math.inf
    message = cycle.nothing_recorded(ran=12, start_step=24, held=0, start_delay=0)
    assert message == (
        "ProfilerSchedule recorded nothing: this run resumed after 24 batches and trained "
        "12 more, but the schedule's 3 windows (`repeat=3`) all fall in the first "
        "skip_first + repeat x (wait + warmup + active) = 0 + 3 x (1 + 1 + 1) = 9 batches: "
        "a resumed run counts batches from the start of training. Set `repeat=0` (a window "
        "every cycle until training ends) or `repeat=9` or more, or `skip_first=24` to "
        "begin the cycles where this run resumed."
    )
    # each fix named records a window in batches 24-35, and one repeat fewer does not
    for fix in ({"repeat": 0}, {"repeat": 9}, {"skip_first": 24}):
        fixed = ProfilerCycle(**{"skip_first": 0, "wait": 1, "warmup": 1, "active": 1,
                                 "repeat": 3, **fix})  # fmt: skip
        assert records_in(fixed, 24, 36), fix
    assert not records_in(ProfilerCycle(0, 1, 1, 1, repeat=8), 24, 36)


def test_windows_behind_a_resume_too_short_for_one_say_how_long_to_train() -> None:
    # 2 held batches shift the schedule: its 2 windows end at batch 2 + 2 x 5 + 2 = 14;
    # the resume at batch 20 is position 18, inside cycle 3 (the 4th) before its warm-up.
    cycle = ProfilerCycle(skip_first=2, wait=2, warmup=1, active=2, repeat=2)
    message = cycle.nothing_recorded(ran=3, start_step=20, held=0, start_delay=2)
    assert message.endswith(
        "= 2 + 2 x (2 + 1 + 2) + 2 held while torch.compile compiled = 14 batches: a "
        "resumed run counts batches from the start of training. Set `repeat=0` (a window "
        "every cycle until training ends) or `repeat=4` or more, or `skip_first=18` to "
        "begin the cycles where this run resumed, and train at least 4 batches after "
        "resuming."
    )
    more = ProfilerCycle(skip_first=2, wait=2, warmup=1, active=2, repeat=4)
    assert not records_in(more, 18, 18 + 3)
    assert records_in(more, 18, 18 + 4)
    later = ProfilerCycle(skip_first=18, wait=2, warmup=1, active=2, repeat=2)
    assert not records_in(later, 18, 18 + 4)
    assert records_in(later, 18, 18 + 5)
    assert "train at least" not in cycle.nothing_recorded(
        ran=4, start_step=20, held=0, start_delay=2)  # fmt: skip


@pytest.mark.parametrize("field", ["skip_first", "wait", "warmup", "active", "repeat"])
def test_a_negative_argument_is_refused_by_name(field: str) -> None:
    kwargs = {"skip_first": 0, "wait": 0, "warmup": 0, "active": 1, "repeat": 0, field: -1}
    with pytest.raises(SpeedkitConfigError, match=f"`{field}`"):
        ProfilerCycle(**kwargs)
