"""NumWorkersTuner's judgements without a Trainer: set step times, rates and core counts in,
exact verdicts, budgets, searches and sentences out."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_speedkit.data import _verdict, worker_search
from lightning_speedkit.data._verdict import (
    StepPace,
    cores_to_search,
    judge_found,
    search_spare_cores,
    start_metrics,
    tuned_message,
    verdict,
    verdict_message,
    worker_budget,
)
from lightning_speedkit.data.tune_result import TuneResult

from ..helpers.models import loader


def _in_use(rate: float, workers: int = 0) -> TuneResult:
    return TuneResult({"num_workers": workers}, [], best_batches_per_sec=rate)


def test_the_pace_leaves_the_warm_up_out_and_keeps_the_steps_asked_for() -> None:
    pace = StepPace(steps=3, warmup=2)
    timing = []
    ready = []
    for seconds in (5.0, 4.0, 0.5, 0.25, 0.5):
        timing.append(pace.timing())
        ready.append(pace.add(seconds if pace.timing() else None))
    assert timing == [False, False, True, True, True]
    assert ready == [False, False, False, False, True]
    assert pace.times == [0.5, 0.25, 0.5]


@pytest.mark.parametrize(
    ("times", "loader_rate", "bound", "model_rate"),
    [([0.001, 0.004, 0.001], 10.3, True, 1000.0), ([0.5, 0.25, 0.5], 2.0, False, 2.0),
     ([0.125, 0.5], 3.0, True, 1 / 0.3125)],
)  # fmt: skip
def test_the_verdict_compares_the_median_step_with_the_loader(
    times: list[float], loader_rate: float, bound: bool, model_rate: float
) -> None:
    assert verdict(times, loader_rate) == {
        "data_bound": bound, "loader_batches_per_sec": loader_rate,
        "model_batches_per_sec": model_rate,
    }  # fmt: skip


def test_the_verdict_says_how_far_behind_data_is_and_what_to_try() -> None:
    assert verdict_message(verdict([0.001], 10.3)) == (
        "NumWorkersTuner: data loading IS the bottleneck: the loader delivers 10.3 batches/s, "
        "the model consumes 1000.0 (97.1x)." + _verdict.ADVICE
    )
    assert verdict_message(verdict([0.5], 24.0)) == (
        "NumWorkersTuner: data loading is not the bottleneck: the loader delivers 24.0 "
        "batches/s, the model consumes 2.0."
    )


@pytest.mark.parametrize(
    ("cores", "on_cpu", "threads", "budget", "said"),
    [(4, False, 4, 3, None), (1, False, 1, 0, None), (4, True, 2, 2, None),
     (1, True, 1, 0, "one core for this rank"), (2, True, 2, 0, "pass `compute_threads`")],
)  # fmt: skip
def test_the_worker_budget_leaves_the_compute_its_cores(
    cores: int, on_cpu: bool, threads: int, budget: int, said: str | None
) -> None:
    got, message = worker_budget(cores, on_cpu, threads)
    assert got == budget
    assert (message is None) if said is None else (said in str(message))


def test_what_setup_found_is_said_with_its_gain_and_logged() -> None:
    best = {"num_workers": 2, "pin_memory": False, "persistent_workers": True,
            "prefetch_factor": 2}  # fmt: skip
    result = TuneResult(best, [], 24.0, given_batches_per_sec=10.0, seconds=3.25)
    assert tuned_message(result, best) == (
        "NumWorkersTuner: num_workers=2, pin_memory=False, persistent_workers=True, "
        "prefetch_factor=2: 24.0 batches/s, 2.40x the loader as given (tuned in 3.2 s)."
    )
    cached = TuneResult({"num_workers": 0, "prefetch_factor": None}, [], 9.5, cached=True)
    assert tuned_message(cached, cached.best) == (
        "NumWorkersTuner: num_workers=0: 9.5 batches/s (cached)."
    )
    assert start_metrics(best, result) == {
        "data/num_workers": 2.0, "data/loader_batches_per_sec": 24.0,
    }  # fmt: skip
    assert start_metrics({"num_workers": 1}, None) == {"data/num_workers": 1.0}


def test_a_loader_left_untuned_is_said_so_and_logs_no_rate() -> None:
    """A stream from a source opened once is never measured: no 0.0 batches/s said or logged."""
    untuned = TuneResult({"num_workers": 0}, [], 0.0, untuned="the IterableDataset reads ...")
    assert tuned_message(untuned, untuned.best) == (
        "NumWorkersTuner: num_workers=0: the loader as given, untuned."
    )
    assert start_metrics(untuned.best, untuned) == {"data/num_workers": 0.0}


@pytest.mark.parametrize(
    ("in_use", "model_rate", "searched", "spare"),
    [
        (_in_use(10.3), 731.0, 0, 2),  # the issue: the model needs 0.06 cores
        (_in_use(10.3), 731.0, 2, None),  # ... but the search at setup had both already
        (_in_use(94.0), 34.0, 0, None),  # not data-bound: the compute needs both cores
        (_in_use(20.0, workers=2), 40.0, 0, 1),  # per process 10/s: the compute needs 1 core
    ],
)
def test_a_search_on_spare_cores_only_when_there_are_more_than_were_searched(
    in_use: TuneResult, model_rate: float, searched: int, spare: int | None
) -> None:
    search = cores_to_search(2, 2, model_rate, in_use, searched)
    assert (None if search is None else search[0]) == spare
    if search is not None:
        cores = "1 core" if spare == 1 else f"{spare} cores"
        assert search[1].endswith(f"measuring loader workers on {cores} (training waits).")


def test_one_core_is_said_as_one() -> None:
    """It read 'of this rank's 1 cores' and 'on 1 cores'."""
    search = cores_to_search(1, 1, 731.0, _in_use(10.3), searched=0)
    assert search == (1, (
        "NumWorkersTuner: at the loader's pace the model needs about 0.014 of this rank's "
        "1 core, not the 1 its threads were left; measuring loader workers on 1 core "
        "(training waits)."
    ))  # fmt: skip


def test_a_found_setting_counts_only_when_it_differs_and_was_measured() -> None:
    in_use = _in_use(10.0)
    assert judge_found(TuneResult({"num_workers": 2}, [], 24.0), in_use) == (
        True, "NumWorkersTuner: num_workers=2: 24.0 batches/s, 2.40x the loader in use.",
    )  # fmt: skip
    stays = "NumWorkersTuner: no setting beat num_workers=0; the loader stays."
    assert judge_found(TuneResult({"num_workers": 0}, [], 11.0), in_use) == (False, stays)
    assert judge_found(TuneResult({"num_workers": 2}, [], 0.0), in_use) == (False, stays)


def test_the_spare_cores_search_measures_on_them_and_returns_only_a_winner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[dict[str, Any]] = []
    found = TuneResult({"num_workers": 2}, [], 24.0)

    def tune(dataloader: Any, **kwargs: Any) -> TuneResult:
        calls.append(kwargs)
        return found

    monkeypatch.setattr(worker_search, "tune_num_workers", tune)
    kw: dict[str, Any] = {
        "cores": 2,
        "threads": 2,
        "tune_kwargs": {"max_workers": None, "batches": 5},
    }
    assert search_spare_cores(loader(), _in_use(10.3), 731.0, searched=0, **kw) is found
    assert calls == [{"max_workers": 2, "batches": 5}]
    assert search_spare_cores(loader(), _in_use(10.3), 731.0, searched=2, **kw) is None
    assert len(calls) == 1  # no more cores than the search at setup had: not measured
    assert search_spare_cores(loader(), _in_use(30.0, workers=2), 731.0, searched=0, **kw) is None
    assert len(calls) == 2  # measured, and nothing beat the loader in use
