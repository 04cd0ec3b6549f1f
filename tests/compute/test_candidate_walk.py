"""The micro-batch search as a pure function: fake trials, fake ranks, exact tables."""

from __future__ import annotations

from collections.abc import Callable

from lightning_speedkit.compute import StepMeasurement
from lightning_speedkit.compute._candidate_walk import (
    Skipped,
    candidate_sizes,
    default_candidates,
    verdict,
    walk,
)

GIB = 2**30


def _trials(outcomes: dict[int, StepMeasurement | Skipped]) -> tuple[Callable, list[int]]:
    ran: list[int] = []

    def trial(n: int) -> StepMeasurement | Skipped:
        ran.append(n)
        return outcomes[n]

    return trial, ran


def _alone(ok: bool) -> bool:
    return ok


def test_default_candidates_are_powers_of_two_and_the_loaders_own_size() -> None:
    assert default_candidates(12, 32) == [1, 2, 4, 8, 12, 16, 32]
    assert default_candidates(64, 32) == [1, 2, 4, 8, 16, 32]
    assert default_candidates(None, 5) == [1, 2, 4]


def test_only_sizes_that_divide_each_ranks_share_and_stay_under_the_cap_are_tried() -> None:
    assert candidate_sizes([3, 4, 8, 16, 32], None, 16, 32) == ([4, 8, 16], [3, 32], 16)
    assert candidate_sizes(None, 6, None, 12) == ([1, 2, 4, 6], [], 12)  # 8 does not divide 12
    assert candidate_sizes([5, 7], 4, None, None) == ([5, 7], [], None)


def test_the_fastest_per_sample_wins_not_the_largest() -> None:
    trial, ran = _trials({4: StepMeasurement(0.004), 8: StepMeasurement(0.005),
                          16: StepMeasurement(0.020)})  # fmt: skip
    table, failures = walk([4, 8, 16], None, trial, _alone)
    assert ran == [4, 8, 16]
    assert failures == []
    assert [r["samples_per_sec"] for r in table] == [1000.0, 1600.0, 800.0]
    assert [r["step_ms"] for r in table] == [4.0, 5.0, 20.0]
    best = verdict(table, _alone)
    assert best is not None
    assert best["micro_batch"] == 8


def test_a_size_predicted_over_the_limit_is_not_run_and_stops_the_walk() -> None:
    trial, ran = _trials({1: StepMeasurement(0.01, 2 * GIB), 2: StepMeasurement(0.01, 3 * GIB),
                          4: StepMeasurement(0.01, 5 * GIB)})  # fmt: skip
    table, _ = walk([1, 2, 4, 8], 4 * GIB, trial, _alone)
    assert ran == [1, 2]  # 4 predicted at 3 + 2 x 1 = 5 GiB
    assert [r["micro_batch"] for r in table] == [1, 2, 4]
    assert table[2]["skipped"] == "predicted peak 5.00 GiB over the limit 4.00 GiB"
    assert [r["fits"] for r in table] == [True, True, False]


def test_a_measured_peak_over_the_limit_does_not_fit_and_stops() -> None:
    trial, ran = _trials({2: StepMeasurement(0.01, 3 * GIB), 4: StepMeasurement(0.01, 9 * GIB)})
    table, _ = walk([2, 4, 8], 8 * GIB, trial, _alone)
    assert ran == [2, 4]
    assert table[1]["skipped"] == "peak 9.00 GiB over the limit 8.00 GiB"
    assert verdict(table, _alone)["micro_batch"] == 2  # type: ignore[index]


def test_a_failed_step_skips_its_size_and_out_of_memory_stops() -> None:
    error = ValueError("Expected more than 1 value per channel")
    trial, ran = _trials({1: Skipped("the step failed: ValueError", error=error),
                          2: StepMeasurement(0.01), 4: Skipped("out of memory", stop=True),
                          8: StepMeasurement(0.01)})  # fmt: skip
    table, failures = walk([1, 2, 4, 8], None, trial, _alone)
    assert ran == [1, 2, 4]
    assert failures == [error]
    assert [r["skipped"] for r in table] == ["the step failed: ValueError", None, "out of memory"]


def test_ranks_stop_together_and_a_size_counts_only_where_it_fits_on_every_rank() -> None:
    # another rank stops before size 4 runs, and does not fit size 2
    answers = iter([True, True, False,  # the walk: sizes 1 and 2 go on, 4 does not
                    True, False])  # the verdict: 1 fits everywhere, 2 not  # fmt: skip
    calls: list[bool] = []

    def agree(ok: bool) -> bool:
        calls.append(ok)
        return ok and next(answers)

    trial, ran = _trials({1: StepMeasurement(0.01), 2: StepMeasurement(0.01)})
    table, _ = walk([1, 2, 4], None, trial, agree)
    assert ran == [1, 2]
    assert table[2]["skipped"] == "another rank stopped"
    best = verdict(table, agree)
    assert table[1]["skipped"] == "does not fit on another rank"
    assert best is not None
    assert best["micro_batch"] == 1
    assert calls == [True, True, True, True, True, False]


def test_a_zero_time_has_no_rate_and_cannot_win() -> None:
    trial, _ = _trials({1: StepMeasurement(0.0)})
    table, _ = walk([1], None, trial, _alone)
    assert table[0]["samples_per_sec"] is None
    assert verdict(table, _alone) is None
