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
