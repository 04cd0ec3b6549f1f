"""The default measurement on a clock the test moves: warm-ups untimed, the median timed."""

from __future__ import annotations

import pytest

from lightning_speedkit.compute import _step_timer
from lightning_speedkit.compute._step_timer import StepMeasurement, timed_measure


def test_warmups_are_not_timed_and_the_median_of_the_repeats_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [0.0]
    monkeypatch.setattr(_step_timer.time, "perf_counter", lambda: now[0])
    durations = iter([100.0, 2.0, 9.0, 3.0])  # the warm-up, then three timed runs
    runs: list[int] = []

    def run() -> None:
        runs.append(1)
        now[0] += next(durations)

    measured = timed_measure("meta", warmup=1, repeats=3)(run, 8)
    assert measured == StepMeasurement(seconds=3.0, peak_bytes=None)  # no peak on meta
    assert len(runs) == 4


class _Clock:
    """A clock each run moves by its own duration."""

    def __init__(self, durations: list[float]) -> None:
        self.now = 0.0
        self.durations = iter(durations)
        self.runs = 0

    def __call__(self) -> float:
        return self.now

    def run(self) -> None:
        self.runs += 1
        self.now += next(self.durations)


def test_a_short_step_is_repeated_until_the_timed_runs_add_up_to_the_minimum() -> None:
    step = 2.0**-12  # 0.24 ms: 81 runs are 19.8 ms, 82 are 20.0 ms
    clock = _Clock([1.0] + [step] * 100)  # a slow warm-up (it does not count), then short runs
    measured = timed_measure("meta", clock=clock)(clock.run, 1)
    assert clock.runs == 1 + 82
    assert measured.seconds == step


def test_a_very_short_step_stops_at_the_cap_on_runs() -> None:
    clock = _Clock([2.0**-20] * 100)  # 1 microsecond: 50 runs are far short of 20 ms
    measured = timed_measure("meta", warmup=0, max_runs=50, clock=clock)(clock.run, 1)
    assert clock.runs == 50
    assert measured.seconds == 2.0**-20


@pytest.mark.parametrize(
    ("durations", "kwargs", "runs", "median"),
    [
        ([0.25, 0.5, 0.25, 9.0], {}, 3, 0.25),  # long steps: just `repeats`
        ([0.001] * 10, {"min_seconds": 0.0}, 3, 0.001),  # no minimum: just `repeats`
        ([0.001] * 10, {"repeats": 5, "max_runs": 2}, 5, 0.001),  # never fewer than `repeats`
        ([0.008, 0.001, 0.008, 0.004, 0.5], {}, 4, 0.006),  # 17 ms after 3: a fourth
    ],
)
def test_the_minimum_time_adds_runs_only_where_the_repeats_fall_short(
    durations: list[float], kwargs: dict[str, float], runs: int, median: float
) -> None:
    clock = _Clock(durations)
    measured = timed_measure("meta", warmup=0, clock=clock, **kwargs)(clock.run, 1)  # type: ignore[arg-type]
    assert clock.runs == runs
    assert measured.seconds == pytest.approx(median)
