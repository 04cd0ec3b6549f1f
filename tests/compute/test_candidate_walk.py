"""The micro-batch search as a pure function: fake trials, fake ranks, exact tables."""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
from collections.abc import Callable

import pytest

from lightning_speedkit.compute import StepMeasurement
from lightning_speedkit.compute._candidate_walk import (
    Skipped,
    candidate_sizes,
    confirm,
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


def _sequence(outcomes: dict[int, list[StepMeasurement | Skipped]]) -> tuple[Callable, list[int]]:
    """A trial that gives each size's outcomes in turn: a first measurement, then re-timings."""
    ran: list[int] = []
    left = {n: iter(seen) for n, seen in outcomes.items()}

    def trial(n: int) -> StepMeasurement | Skipped:
        ran.append(n)
        return next(left[n])

    return trial, ran


def _search(trial: Callable, sizes: list[int], agree: Callable = _alone, limit: int | None = None,
            rounds: int = 3) -> tuple[list[dict], dict | None]:  # fmt: skip
    table, _ = walk(sizes, limit, trial, agree)
    return table, confirm(table, verdict(table, agree), trial, agree, rounds)


def test_a_busy_spell_over_the_runner_ups_first_measurement_is_undone_by_the_retiming() -> None:
    # Truly 1 -> 2000/s and 32 -> 8000/s. The walk saw 1 at an idle moment (4000/s) and
    # 2 and 32 in a busy spell (32 six times slower: 1333/s), so 1 led. Re-timed in turns,
    # a spell in the second round hits both alike, and the medians put 32 first.
    trial, ran = _sequence({
        1: [StepMeasurement(0.00025), StepMeasurement(0.0005), StepMeasurement(0.003),
            StepMeasurement(0.0005)],
        2: [StepMeasurement(0.008)],
        32: [StepMeasurement(0.024), StepMeasurement(0.004), StepMeasurement(0.024),
             StepMeasurement(0.004)],
    })  # fmt: skip
    table, best = _search(trial, [1, 2, 32])
    assert ran == [1, 2, 32, 1, 32, 1, 32, 1, 32]  # 1 and 32 interleaved, three rounds each
    assert best is not None
    assert best["micro_batch"] == 32
    assert [r["samples_per_sec"] for r in table] == pytest.approx([4000.0, 250.0, 32 / 0.024])
    assert [r["confirmed_samples_per_sec"] for r in table] == [
        pytest.approx(2000.0), None, pytest.approx(8000.0)
    ]  # fmt: skip


def test_a_winner_that_holds_its_lead_when_retimed_stays() -> None:
    trial, ran = _sequence({4: [StepMeasurement(0.004)] * 4, 8: [StepMeasurement(0.005)] * 4,
                            16: [StepMeasurement(0.020)]})  # fmt: skip
    table, best = _search(trial, [4, 8, 16], rounds=2)
    assert ran == [4, 8, 16, 4, 8, 4, 8]  # two rounds: the winner (8) and the runner-up (4)
    assert best is table[1]
    assert [r["confirmed_samples_per_sec"] for r in table] == [1000.0, 1600.0, None]


@pytest.mark.parametrize(
    ("outcomes", "limit", "rounds"),
    [
        ({1: [StepMeasurement(0.01)]}, None, 3),  # one size
        ({1: [StepMeasurement(0.01, GIB)], 2: [StepMeasurement(0.01, 9 * GIB)]}, 4 * GIB, 3),
        ({1: [StepMeasurement(0.01)], 2: [StepMeasurement(0.03)]}, None, 0),  # switched off
    ],
    ids=["one-size", "the-other-does-not-fit", "rounds-0"],
)
def test_without_a_runner_up_or_rounds_nothing_is_retimed(
    outcomes: dict[int, list[StepMeasurement]], limit: int | None, rounds: int
) -> None:
    trial, ran = _sequence(outcomes)
    table, best = _search(trial, sorted(outcomes), limit=limit, rounds=rounds)
    assert ran == sorted(outcomes)
    assert best is table[0]
    assert all(r["confirmed_samples_per_sec"] is None for r in table)


def test_a_retiming_that_fails_keeps_the_first_verdict() -> None:
    oom = Skipped("out of memory", stop=True)
    trial, ran = _sequence({1: [StepMeasurement(0.01)] * 4, 2: [StepMeasurement(0.01), oom]})
    table, best = _search(trial, [1, 2])
    assert ran == [1, 2, 1, 2]  # nothing more after the failed re-run
    assert best is table[1]
    assert all(r["confirmed_samples_per_sec"] is None for r in table)


def _ranks(count: int) -> list[Callable[[bool], bool]]:
    """``agree`` for ``count`` ranks in threads: each call waits for every rank's (an
    unequal number of calls breaks the barrier), and answers True only if all were."""
    barrier = threading.Barrier(count, timeout=5)
    votes: dict[int, list[bool]] = collections.defaultdict(list)

    def agree_for(rank: int) -> Callable[[bool], bool]:
        calls = itertools.count()

        def agree(ok: bool) -> bool:
            i = next(calls)
            votes[i].append(ok)
            barrier.wait()
            return all(votes[i])

        return agree

    return [agree_for(rank) for rank in range(count)]


def _in_lockstep(trials: list[Callable]) -> list[dict | None]:
    agrees = _ranks(len(trials))
    with concurrent.futures.ThreadPoolExecutor(len(trials)) as pool:
        searches = [pool.submit(_search, trial, [1, 2, 4], agree)
                    for trial, agree in zip(trials, agrees, strict=True)]  # fmt: skip
        return [search.result()[1] for search in searches]


def test_ranks_retime_the_same_pair_in_lockstep_and_stop_together() -> None:
    fast, slow = StepMeasurement(0.001), StepMeasurement(0.004)
    # both ranks: 2 fastest, then 4; rank 1's second re-run of 4 runs out of memory
    trial0, ran0 = _sequence({1: [slow], 2: [fast] * 4, 4: [fast] * 4})
    trial1, ran1 = _sequence({1: [slow], 2: [fast] * 4, 4: [fast, fast, Skipped("oom")]})
    best = _in_lockstep([trial0, trial1])
    assert ran0 == ran1 == [1, 2, 4, 2, 4, 2, 4]  # no rank runs the third round
    assert [b["micro_batch"] for b in best] == [4, 4]  # type: ignore[index]  # first verdicts


def test_ranks_that_disagree_on_the_pair_retime_nothing() -> None:
    fast, slow = StepMeasurement(0.001), StepMeasurement(0.004)
    trial0, ran0 = _sequence({1: [slow], 2: [fast] * 4, 4: [fast] * 4})  # 4 and 2
    trial1, ran1 = _sequence({1: [fast] * 4, 2: [slow], 4: [fast] * 4})  # 4 and 1
    best = _in_lockstep([trial0, trial1])
    assert ran0 == ran1 == [1, 2, 4]
    assert [b["micro_batch"] for b in best] == [4, 4]  # type: ignore[index]
