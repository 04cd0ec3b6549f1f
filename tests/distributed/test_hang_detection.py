"""StepWatch and step_limit: the watchdog's limit and overrun decisions on exact clock readings."""

from __future__ import annotations

import pytest

from lightning_speedkit.distributed._hang_detection import (
    Overrun,
    Recovery,
    StepWatch,
    poll_interval,
    progress_of,
    step_limit,
    where_of,
)
from lightning_speedkit.distributed._hang_report import (
    BACKWARD,
    EPOCH_END,
    SAVING,
    VALIDATING,
    RankProgress,
)


@pytest.mark.parametrize(
    ("durations", "timeout", "factor", "min_timeout", "expected"),
    [
        ([], None, 10.0, 60.0, 600.0),  # warm-up: factor x min_timeout
        ([1.0] * 4, None, 10.0, 60.0, 600.0),
        ([1.0] * 5, None, 10.0, 60.0, 60.0),  # the floor
        ([300.0, 8.0, 9.0, 7.0, 8.0], None, 10.0, 60.0, 80.0),  # factor x median
        ([1.0, 2.0, 3.0, 100.0, 5.0, 4.0], None, 2.5, 1.0, 8.75),
        ([1.0] * 6, 30.0, 10.0, 60.0, 30.0),  # a fixed timeout, whatever the steps
    ],
)
def test_step_limit(durations: list[float], timeout: float | None, factor: float,
                    min_timeout: float, expected: float) -> None:  # fmt: skip
    assert step_limit(durations, timeout, factor, min_timeout) == expected


@pytest.mark.parametrize(
    ("timeout", "min_timeout", "expected"),
    [(None, 60.0, 1.0), (5.0, 60.0, 0.5), (0.2, 60.0, 0.05), (None, 2.0, 0.2)],
)
def test_poll_interval(timeout: float | None, min_timeout: float, expected: float) -> None:
    assert poll_interval(timeout, min_timeout) == expected


def test_a_step_overruns_once_and_recovers_with_its_duration() -> None:
    watch = StepWatch(timeout=10.0, factor=10.0, min_timeout=60.0)
    watch.start(now=100.0, global_step=7)
    watch.enter(BACKWARD, now=101.0)
    assert watch.overrun(watch.mark, now=110.0) is None  # at the limit: not past it
    assert watch.overrun(watch.mark, now=110.5) == Overrun(
        batch=1, step=7, seconds=10.5, limit=10.0, between=False, where=(1, False)
    )
    assert watch.overrun(watch.mark, now=150.0) is None  # once per step
    assert watch.recovery() is None  # still running
    watch.end(now=115.0)
    assert watch.recovery() == Recovery(batch=1, step=7, seconds=15.0, limit=10.0, between=False)
    assert watch.recovery() is None  # once
    assert list(watch.steps) == [(1, 15.0)]


def test_the_time_between_steps_overruns_from_the_steps_end() -> None:
    watch = StepWatch(timeout=10.0, factor=10.0, min_timeout=60.0)
    watch.start(now=0.0, global_step=0)
    watch.end(now=4.0)
    assert watch.overrun(watch.mark, now=14.0) is None
    overrun = watch.overrun(watch.mark, now=14.5)
    assert overrun is not None
    assert (overrun.seconds, overrun.between, overrun.where) == (10.5, True, (1, True))
    assert overrun.why == "this rank's has been between steps 10.5 s, past its limit of 10.0 s"
    assert watch.recovery() is None  # still between steps
    watch.start(now=30.0, global_step=1)  # the next batch begins 26 s after the step's end
    assert watch.recovery() == Recovery(batch=1, step=0, seconds=26.0, limit=10.0, between=True)


def test_the_relative_limit_after_warm_up() -> None:
    watch = StepWatch(timeout=None, factor=10.0, min_timeout=2.0)
    now = 0.0
    for _ in range(5):
        watch.start(now, global_step=0)
        now += 0.5
        watch.end(now)
    assert watch.limit() == 5.0  # 10 x the median 0.5 s
    watch.start(now, global_step=5)
    assert watch.overrun(watch.mark, now + 5.0) is None
    overrun = watch.overrun(watch.mark, now + 5.25)
    assert overrun is not None
    assert (overrun.batch, overrun.seconds, overrun.limit) == (6, 5.25, 5.0)


@pytest.mark.parametrize("phase", [VALIDATING, SAVING, EPOCH_END])
def test_validation_saves_and_epoch_ends_never_overrun(phase: int) -> None:
    watch = StepWatch(timeout=1.0, factor=10.0, min_timeout=60.0)
    watch.start(now=0.0, global_step=0)
    watch.end(now=0.5)
    watch.enter(phase, now=0.6)
    assert watch.overrun(watch.mark, now=1000.0) is None


def test_validation_end_returns_between_steps() -> None:
    watch = StepWatch(timeout=10.0, factor=10.0, min_timeout=60.0)
    watch.start(now=0.0, global_step=0)
    watch.end(now=1.0)
    watch.enter(VALIDATING, now=1.0)
    watch.end_validation(now=301.0)
    overrun = watch.overrun(watch.mark, now=312.0)
    assert overrun is not None
    assert (overrun.seconds, overrun.between) == (11.0, True)  # counted from validation's end


def test_no_batch_yet() -> None:
    watch = StepWatch(timeout=1.0, factor=10.0, min_timeout=60.0)
    watch.enter(BACKWARD, now=5.0)  # nothing to enter before the first batch
    assert watch.mark is None
    assert where_of(None) == (0, False)
    assert progress_of(None, 3, now=9.0) == RankProgress(3, 0, 0, "between steps", 0.0)
    watch.start(now=1.0, global_step=4)
    watch.enter(BACKWARD, now=2.0)
    assert progress_of(watch.mark, 3, now=4.5) == RankProgress(3, 1, 4, "backward", 2.5)


def test_a_pause_in_the_step_is_unwatched_and_left_out_of_its_age_and_duration() -> None:
    """NumWorkersTuner's search holds every rank inside a batch's end: not a hang."""
    watch = StepWatch(timeout=10.0, factor=10.0, min_timeout=60.0)
    watch.start(now=0.0, global_step=3)
    watch.enter(BACKWARD, now=2.0)
    watch.pause(now=4.0)
    assert progress_of(watch.mark, 0, now=100.0).phase == "paused by a kit callback"
    assert watch.overrun(watch.mark, now=100.0) is None  # 96 s into the pause
    watch.pause(now=110.0)  # a second pause inside the first changes nothing
    watch.resume(now=124.0)  # the pause took 120 s
    assert progress_of(watch.mark, 0, now=125.0) == RankProgress(0, 1, 3, "backward", 3.0)
    assert watch.overrun(watch.mark, now=130.0) is None  # the step's age: 10 s, at the limit
    assert watch.overrun(watch.mark, now=130.5) is not None
    watch.end(now=131.0)
    assert list(watch.steps) == [(1, 11.0)]  # the step's own 11 s, not 131
    watch.resume(now=140.0)  # no pause to end: nothing moves
    assert watch.overrun(watch.mark, now=140.0) is None
    assert watch.overrun(watch.mark, now=141.5) is not None  # between steps from 131.0


def test_a_pause_between_steps_restarts_the_wait_for_the_next_batch() -> None:
    watch = StepWatch(timeout=10.0, factor=10.0, min_timeout=60.0)
    watch.start(now=0.0, global_step=0)
    watch.end(now=1.0)
    watch.pause(now=3.0)
    watch.resume(now=503.0)
    assert watch.overrun(watch.mark, now=511.0) is None  # 8 s between steps, pause left out
    overrun = watch.overrun(watch.mark, now=511.5)
    assert overrun is not None
    assert (overrun.seconds, overrun.between) == (10.5, True)


def test_no_batch_yet_no_pause() -> None:
    watch = StepWatch(timeout=1.0, factor=10.0, min_timeout=60.0)
    watch.pause(now=1.0)
    watch.resume(now=2.0)
    assert watch.mark is None
