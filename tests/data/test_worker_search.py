"""tune_num_workers and its measuring: the pick from set figures and a fake clock, the
rebuilt loader, failures, the cache; one test on the wall clock."""

from __future__ import annotations

import gc
import json
import os
import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Subset

from lightning_speedkit import SpeedkitConfigError, tune_num_workers
from lightning_speedkit.data import worker_search
from lightning_speedkit.data.worker_search import rebuild_dataloader, spare_cores

from ..helpers.garbage import Collecting, uncollected_garbage
from ..helpers.models import SlowDataset, loader
from .conftest import Figures, Rates, StepClock


def _collate(items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"x": torch.stack(items)}


def _init(worker_id: int) -> None:
    torch.manual_seed(1234 + worker_id)


def _user_loader(delay: float = 0.0, **kwargs: Any) -> DataLoader[Any]:
    return DataLoader(
        SlowDataset(n=60, delay=delay), batch_size=4, shuffle=True, drop_last=True,
        collate_fn=_collate, worker_init_fn=_init,
        generator=torch.Generator().manual_seed(7), **kwargs,
    )  # fmt: skip


def _xs(dl: DataLoader[Any]) -> list[torch.Tensor]:
    return [b["x"] for b in dl]


def test_rebuilt_loader_keeps_everything_but_the_worker_settings() -> None:
    original = _user_loader()
    state = original.generator.get_state()  # type: ignore[union-attr]
    expected = _xs(original)
    original.generator.set_state(state)  # type: ignore[union-attr]
    rebuilt = rebuild_dataloader(
        original, num_workers=2, persistent_workers=True, prefetch_factor=4
    )
    assert (rebuilt.num_workers, rebuilt.prefetch_factor) == (2, 4)
    assert rebuilt.sampler is original.sampler  # shuffle and generator
    assert (rebuilt.batch_size, rebuilt.drop_last) == (4, True)
    assert rebuilt.collate_fn is _collate
    assert rebuilt.worker_init_fn is _init
    got = _xs(rebuilt)
    assert len(got) == 15
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_distributed_sampler_is_kept() -> None:
    dataset = SlowDataset(n=40)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=False)
    original = DataLoader(dataset, batch_size=5, sampler=sampler)
    rebuilt = rebuild_dataloader(original, num_workers=1)
    assert rebuilt.sampler is sampler
    assert torch.equal(torch.cat(list(rebuilt)), dataset.data[1::2])


def test_tuning_consumes_no_randomness_the_user_would_see(
    paced: Callable[[Rates], Figures],
) -> None:
    paced({0: 50.0, 1: 80.0, (1, 4): 80.0})  # every candidate iterates its trial loader
    original = _user_loader()
    state = original.generator.get_state()  # type: ignore[union-attr]
    expected = _xs(original)
    original.generator.set_state(state)  # type: ignore[union-attr]
    global_state = torch.get_rng_state()
    result = tune_num_workers(original, max_workers=1, batches=3, cache=False, progress=False)
    assert torch.equal(torch.get_rng_state(), global_state)
    assert result.dataloader is not None
    assert result.dataloader.num_workers == 1
    got = _xs(result.dataloader)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_tuning_leaves_a_samplers_own_generator_where_it_was(
    paced: Callable[[Rates], Figures],
) -> None:
    """A sampler seeded apart from the loader (``RandomSampler(ds, generator=g)``) is
    shared with the trial loaders; its first real epoch must be the one it would have had."""
    paced({0: 50.0, 1: 80.0, (1, 4): 80.0})

    def user_loader() -> DataLoader[Any]:
        dataset = SlowDataset(n=60)
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(3))
        return DataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=_collate)

    expected = _xs(user_loader())
    result = tune_num_workers(user_loader(), max_workers=1, batches=3, cache=False, progress=False)
    assert result.dataloader is not None
    got = _xs(result.dataloader)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def _rows(table: list[dict[str, Any]]) -> list[tuple[int, int | None, bool, float | None]]:
    return [(r["num_workers"], r["prefetch_factor"], r["given"], r["batches_per_sec"])
            for r in table]  # fmt: skip


def _rate(figure: float) -> Any:
    """A rate as the search measures it on the paced clock: the figure, but for rounding."""
    return pytest.approx(figure, rel=1e-9)


def test_more_workers_win_at_the_rate_they_were_measured_at(
    paced: Callable[[Rates], Figures],
) -> None:
    """The search's own measuring loop, on a clock where 2 workers deliver 115 batches/s
    against 62.5 in the training process: 2 workers win, each rate is the one measured,
    and the deeper prefetch, 2.6% faster, is inside the noise band (``min_gain``)."""
    figures = paced({0: 62.5, 1: 60.0, 2: 115.0, (2, 4): 118.0})
    result = tune_num_workers(loader(n=400, batch_size=4), max_workers=2, batches=15,
                              cache=False, progress=False)  # fmt: skip
    assert figures.seen == [(0, None), (1, 2), (2, 2), (2, 4)]
    assert _rows(result.table) == [
        (0, None, True, _rate(62.5)),  # the loader as given; also the num_workers=0 candidate
        (1, 2, False, _rate(60.0)),
        (2, 2, False, _rate(115.0)),
        (2, 4, False, _rate(118.0)),
    ]
    assert (result.best["num_workers"], result.best["prefetch_factor"]) == (2, 2)
    assert result.best["persistent_workers"] is True
    assert result.best_batches_per_sec == _rate(115.0)
    assert result.given_batches_per_sec == _rate(62.5)
    assert result.dataloader is not None
    assert (result.dataloader.num_workers, result.dataloader.prefetch_factor) == (2, 2)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes")
@pytest.mark.parametrize(
    ("min_gain", "seen", "best", "rate"),
    [
        # 2 workers are 4% faster than 1, inside a 5% band: the search stops there (4 is
        # never tried, however fast), and the deeper prefetch, 4.5% faster, loses too.
        (0.05, [(0, None), (1, 2), (2, 2), (1, 4)], (1, 2), 20.0),
        # In a 3% band 2 workers count as faster, so 4 are tried and win.
        (0.03, [(0, None), (1, 2), (2, 2), (4, 2), (4, 4)], (4, 2), 40.0),
    ],
)
def test_a_gain_inside_min_gain_does_not_count(
    paced: Callable[[Rates], Figures],
    min_gain: float,
    seen: list[tuple[int, int | None]],
    best: tuple[int, int],
    rate: float,
) -> None:
    figures = paced({0: 10.0, 1: 20.0, 2: 20.8, (1, 4): 20.9, 4: 40.0, (4, 4): 40.5})
    result = tune_num_workers(loader(n=400, batch_size=4), max_workers=4, batches=5,
                              min_gain=min_gain, cache=False, progress=False)  # fmt: skip
    assert figures.seen == seen
    assert (result.best["num_workers"], result.best["prefetch_factor"]) == best
    assert result.best_batches_per_sec == _rate(rate)


@pytest.mark.parametrize(
    ("workers_rate", "best"),
    [(4.9, 0), (5.1, 1)],  # against 10 batches/s in the training process
    ids=["below-half", "above-half"],
)
def test_workers_win_unless_they_deliver_less_than_half_the_in_process_rate(
    workers_rate: float, best: int
) -> None:
    """Workers overlap loading with the step, so they win down to half the in-process rate.
    The loader as given (one worker, prefetch 3) is the slowest, so it decides nothing."""
    dl = DataLoader(SlowDataset(n=64), batch_size=8, num_workers=1, prefetch_factor=3)
    measure = Figures({(1, 3): 3.0, 0: 10.0, 1: workers_rate, 2: workers_rate})
    result = tune_num_workers(dl, max_workers=2, cache=False, progress=False, measure=measure)
    assert measure.seen == [(1, 3), (0, None), (1, 2), (2, 2), (1, 4)]
    assert result.best["num_workers"] == best
    assert result.best_batches_per_sec == (10.0 if best == 0 else workers_rate)


def test_the_search_stops_when_its_time_budget_is_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each reading of the search's clock is one second after the last: the budget of 2.5 s
    is spent at the check after 2 workers, so 4 and 8 and the deeper prefetch are not tried."""
    monkeypatch.setattr(worker_search, "_clock", StepClock(1.0))
    measure = Figures(lambda trial: 10.0 * (1 + trial.num_workers))  # more is always faster
    with pytest.warns(UserWarning, match="time budget of 2 s spent; stopping at num_workers=2"):
        result = tune_num_workers(loader(), max_workers=8, time_budget=2.5, cache=False,
                                  progress=False, measure=measure)  # fmt: skip
    assert measure.seen == [(0, None), (1, 2), (2, 2)]
    assert result.best["num_workers"] == 2
    assert result.seconds == 5.0  # readings: start, after 0, 1 and 2 workers, before the
    # deeper prefetch (not tried: the budget is spent), at the end


def test_real_timing_smoke() -> None:
    """The one test on the wall clock, and it judges no time: on the real clock, with real
    workers, the search measures every candidate (a rate each, none skipped) and reports
    the pick at the rate its row holds. Which candidate wins is left to the tests above,
    on set figures."""
    slow = loader(n=400, batch_size=4, delay=0.004)
    result = tune_num_workers(slow, max_workers=2, batches=5, min_seconds=0.0, cache=False,
                              progress=False)  # fmt: skip
    assert [(r["num_workers"], r["prefetch_factor"], r["given"]) for r in result.table][:3] == [
        (0, None, True), (1, 2, False), (2, 2, False)
    ]  # fmt: skip
    assert all(r["skipped"] is None for r in result.table)
    assert all(isinstance(r["batches_per_sec"], float) for r in result.table)
    rates = {(r["num_workers"], r["prefetch_factor"]): r["batches_per_sec"] for r in result.table}
    pick = (result.best["num_workers"], result.best["prefetch_factor"])
    assert result.best_batches_per_sec == rates[pick]
    assert result.given_batches_per_sec == rates[0, None]
    assert result.seconds == result.to_json()["seconds"]
    assert result.cached is False


class _CrashInWorkers(SlowDataset):
    def __getitem__(self, i: int) -> torch.Tensor:
        if torch.utils.data.get_worker_info() is not None:
            os._exit(3)
        return super().__getitem__(i)


class _HangInWorkers(SlowDataset):
    def __getitem__(self, i: int) -> torch.Tensor:
        if torch.utils.data.get_worker_info() is not None:
            time.sleep(3600)
        return super().__getitem__(i)


class _Unpicklable(SlowDataset):
    def __init__(self) -> None:
        super().__init__(n=64)
        self.transform = lambda x: x  # a lambda cannot be pickled for spawned workers


@pytest.mark.parametrize(
    ("dataset", "context", "reason"),
    [
        (_CrashInWorkers(n=64), None, "a worker crashed"),
        (_HangInWorkers(n=64), None, "workers hung"),
        (_Unpicklable(), "spawn", "cannot be sent to worker processes"),
    ],
    ids=["crash", "hang", "unpicklable"],
)
def test_failing_candidates_are_skipped_with_the_reason(
    paced: Callable[[Rates], Figures], dataset: Dataset[Any], context: str | None, reason: str
) -> None:
    paced(lambda trial: 20.0)  # the workers' own failures decide; a timeout is real seconds
    workers = 1 if context else 0  # a multiprocessing context needs workers
    bad = DataLoader(dataset, batch_size=4, num_workers=workers, multiprocessing_context=context)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = tune_num_workers(
            bad, max_workers=2, batches=3, timeout=2, cache=False, progress=False
        )
    assert result.best["num_workers"] == 0
    skipped = [row for row in result.table if row["skipped"]]
    assert skipped
    assert all(reason in row["skipped"] for row in skipped)
    if reason == "workers hung":  # cut by the 2 s `timeout` itself, so the search never hangs
        assert {row["skipped"] for row in skipped} == {
            "workers hung (RuntimeError: DataLoader timed out after 2 seconds)"
        }
    assert all(row["num_workers"] > 0 for row in skipped)
    assert any(reason in str(w.message) for w in caught)
    assert result.dataloader is not None
    assert len(list(result.dataloader)) == 16  # and the data is all there


def test_a_collate_fn_that_cannot_be_pickled_is_named_in_the_skip(
    paced: Callable[[Rates], Figures],
) -> None:
    """Under spawn with a lambda collate_fn the skip said the dataset could not be sent."""
    paced(lambda trial: 20.0)
    bad = DataLoader(SlowDataset(n=64), batch_size=4, num_workers=1,
                     multiprocessing_context="spawn",
                     collate_fn=lambda b: torch.stack(b))  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = tune_num_workers(bad, max_workers=2, batches=3, cache=False, progress=False)
    skipped = [row["skipped"] for row in result.table if row["skipped"]]
    assert len(skipped) == 3  # the loader as given, one worker, two
    named = r"the collate_fn \(\S*<lambda>\) cannot be sent to worker processes \(.*\): "
    assert all(re.match(named + ".* define it at module level", reason) for reason in skipped)
    assert any(re.search(f"skipped .*: {named}", str(w.message)) for w in caught)
    assert result.best["num_workers"] == 0


def test_results_are_cached_and_force_retunes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, paced: Callable[[Rates], Figures]
) -> None:
    paced({0: 10.0, 1: 20.0, (1, 4): 20.0})
    dl = loader(n=64)
    first = tune_num_workers(dl, max_workers=1, batches=3, cache_dir=tmp_path, progress=False)
    assert not first.cached
    assert first.best["num_workers"] == 1
    assert list(tmp_path.glob("*.json"))

    def no_measuring(*args: Any, **kwargs: Any) -> float:
        raise AssertionError("measured although cached")

    monkeypatch.setattr(worker_search, "_measure", no_measuring)
    second = tune_num_workers(dl, max_workers=1, batches=3, cache_dir=tmp_path, progress=False)
    assert second.cached
    assert second.best == first.best
    assert second.seconds == 0.0
    with pytest.warns(UserWarning, match="every candidate failed"):
        forced = tune_num_workers(dl, max_workers=1, batches=3, cache_dir=tmp_path, force=True,
                                  progress=False)  # fmt: skip
    assert not forced.cached


class _Fixable(SlowDataset):
    """A dataset whose workers crash until it is fixed; its fingerprint does not change."""

    fingerprint = "captions-v1"
    broken = True


@pytest.mark.parametrize("in_process_works", [False, True], ids=["all-fail", "workers-fail"])
def test_a_result_forced_by_failures_is_not_cached(tmp_path: Path, in_process_works: bool) -> None:
    """Issue 21: once the dataset is fixed, the next run tunes for real, not from a cache
    holding the num_workers=0 that the failures forced."""
    dl = DataLoader(_Fixable(n=64), batch_size=8)

    def measure(trial: DataLoader[Any]) -> float:
        if _Fixable.broken and (trial.num_workers > 0 or not in_process_works):
            raise RuntimeError("DataLoader worker (pid 4242) exited unexpectedly")
        return {0: 10.0, 1: 11.0, 2: 25.0}[trial.num_workers]

    kw: dict[str, Any] = {"max_workers": 2, "cache_dir": tmp_path, "progress": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one warning per failed candidate
        failed = tune_num_workers(dl, measure=measure, **kw)
    assert failed.best["num_workers"] == 0
    assert any(row["skipped"] for row in failed.table)
    assert list(tmp_path.iterdir()) == []  # nothing cached

    _Fixable.broken = False
    try:
        fixed = tune_num_workers(dl, measure=measure, **kw)
    finally:
        _Fixable.broken = True
    assert not fixed.cached
    assert fixed.best["num_workers"] == 2
    assert fixed.best_batches_per_sec == 25.0
    (entry,) = tmp_path.glob("*.json")  # the measured result is cached
    assert json.loads(entry.read_text())["best"]["num_workers"] == 2
    again = tune_num_workers(dl, measure=measure, **kw)
    assert again.cached
    assert again.best == fixed.best


def test_a_cache_entry_holding_failures_is_measured_again(tmp_path: Path) -> None:
    """An entry written by an earlier release, with a candidate that failed, is not trusted."""
    dl = DataLoader(SlowDataset(n=64), batch_size=8)
    measure = Figures({0: 10.0, 1: 11.0, (1, 4): 11.0})
    first = tune_num_workers(dl, max_workers=1, cache_dir=tmp_path, progress=False,
                             measure=measure)  # fmt: skip
    (entry,) = tmp_path.glob("*.json")
    data = json.loads(entry.read_text())
    data["table"][1]["skipped"] = "a worker crashed (RuntimeError: ...)"
    entry.write_text(json.dumps(data))
    second = tune_num_workers(dl, max_workers=1, cache_dir=tmp_path, progress=False,
                              measure=measure)  # fmt: skip
    assert not second.cached
    assert len(measure.seen) == 2 * len(first.table)


def _light(x: torch.Tensor) -> torch.Tensor:
    return x


def _decode(x: torch.Tensor) -> torch.Tensor:
    time.sleep(0.004)  # never called here: the figures stand for it
    return x


class _Decoded(SlowDataset):
    def __init__(self, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(n=512)
        self.transform = transform

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.transform(super().__getitem__(i))


def test_the_cache_keeps_apart_loaders_that_differ_in_what_loading_costs(tmp_path: Path) -> None:
    """Two Subsets of one class, one with a 4 ms transform: the heavy one was handed the
    light one's entry, num_workers=0 'cached' at 32,246 batches/s (it made 57 on two)."""
    rates = {_light: {0: 32246.0, 1: 9000.0, 2: 9500.0},
             _decode: {0: 29.0, 1: 28.5, 2: 57.0}}  # fmt: skip

    def measure(trial: DataLoader[Any]) -> float:
        return rates[trial.dataset.dataset.transform][trial.num_workers]  # type: ignore[attr-defined]

    def tune(transform: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        loader = DataLoader(Subset(_Decoded(transform), range(256)), batch_size=8, shuffle=True)
        return tune_num_workers(loader, max_workers=2, cache_dir=tmp_path, progress=False,
                                measure=measure)  # fmt: skip

    light = tune(_light)
    assert (light.best["num_workers"], light.cached) == (0, False)
    heavy = tune(_decode)
    assert (heavy.best["num_workers"], heavy.cached, heavy.best_batches_per_sec) == (2, False, 57.0)
    assert len(list(tmp_path.glob("*.json"))) == 2
    again = tune(_decode)
    assert (again.best["num_workers"], again.cached, again.best_batches_per_sec) == (2, True, 57.0)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"batches": 0}, "batches"), ({"max_workers": -1}, "max_workers"),
     ({"time_budget": 0}, "time_budget"), ({"local_world_size": 0}, "local_world_size")],
)  # fmt: skip
def test_bad_arguments_name_themselves(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(SpeedkitConfigError, match=f"`{argument}`"):
        tune_num_workers(loader(), progress=False, cache=False, **kwargs)


def test_one_worker_beats_loading_in_the_training_process() -> None:
    """Alone, one worker decodes no faster than the main process; it wins by overlapping
    with training, so within the noise band (``min_gain``) of the in-process rate the
    tuner prefers it."""
    measure = Figures({0: 10.0, 1: 9.6, (1, 4): 9.7})  # 4% slower: noise
    result = tune_num_workers(loader(n=200), max_workers=1, cache=False, progress=False,
                              measure=measure)  # fmt: skip
    assert result.best["num_workers"] == 1
    assert result.best["persistent_workers"] is True
    assert measure.seen == [(0, None), (1, 2), (1, 4)]  # the given loader is num_workers=0


@pytest.mark.parametrize(
    ("given", "rates", "expected"),
    [
        # The case: one worker measured at 0.84x of the loader as given.
        ({}, {0: 10.3, 1: 8.65, (1, 4): 8.7, 2: 9.0}, {"num_workers": 0, "prefetch_factor": None}),
        # The loader as given has workers that no candidate beats: it is kept as it is.
        ({"num_workers": 2, "prefetch_factor": 3},
         {(2, 3): 20.0, 0: 12.0, 1: 13.0, (1, 4): 13.0, (2, 2): 14.0, (2, 4): 13.5},
         {"num_workers": 2, "prefetch_factor": 3, "persistent_workers": False}),
    ],
    ids=["given-in-process", "given-with-workers"],
)  # fmt: skip
def test_a_setting_measured_slower_than_the_loader_as_given_is_not_chosen(
    given: dict[str, Any], rates: dict[Any, float], expected: dict[str, Any]
) -> None:
    dl = DataLoader(SlowDataset(n=64), batch_size=8, **given)
    result = tune_num_workers(dl, max_workers=2, cache=False, progress=False,
                              measure=Figures(rates))  # fmt: skip
    assert result.given_batches_per_sec == max(rates.values())  # the fastest by far
    assert result.best_batches_per_sec == result.given_batches_per_sec
    assert {k: result.best[k] for k in expected} == expected
    assert result.dataloader is not None
    assert result.dataloader.num_workers == dl.num_workers
    measured = [row["num_workers"] for row in result.table if row["batches_per_sec"]]
    assert len(measured) >= 3  # the candidates were measured, and lost


@pytest.mark.parametrize(
    ("cores", "threads", "model", "process", "spare"),
    [
        (2, 2, 731.0, 10.3, 2),  # the issue: the model needs 0.06 cores at the loader's pace
        (2, 2, 34.0, 94.0, 0),  # the demo: not data-bound, the compute needs both cores
        (2, 2, 15.0, 10.0, 0),  # data-bound by 1.5x: the compute still needs both cores
        (2, 1, 40.0, 10.0, 1),  # one thread, busy half the time at two processes' pace
        (8, 4, 100.0, 10.0, 5),  # 8 cores, 4 threads busy 80% of the time: 3.2 cores
        (2, 2, 100.0, 0.0, 0),  # no loader rate known: nothing to go on
    ],
)
def test_spare_cores_are_the_ones_the_compute_does_not_need(
    cores: int, threads: int, model: float, process: float, spare: int
) -> None:
    assert spare_cores(cores, threads, model, process) == spare


def test_a_clean_measurement_shuts_its_workers_down_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Workers terminated under a live pin-memory thread leave it a ConnectionResetError
    traceback (seen on a GPU); after a clean run the workers get the orderly shutdown."""
    import multiprocessing.process

    terminated: list[str] = []
    real = multiprocessing.process.BaseProcess.terminate

    def terminate(self: multiprocessing.process.BaseProcess) -> None:
        terminated.append(self.name)
        real(self)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "terminate", terminate)
    rate = worker_search._measure(_user_loader(num_workers=2), warmup=1, batches=4,
                                  max_seconds=30, timeout=10, clock=StepClock(0.25))  # fmt: skip
    assert rate == 4.0  # 4 batches, 0.25 s apart on the clock: measured to the end
    assert terminated == []


def test_measured_workers_never_finalize_this_processs_garbage(tmp_path: Path) -> None:
    """As for SampleCache.warm: a worker that collects a gloo process group hangs."""
    log = tmp_path / "finalized_in"
    with uncollected_garbage(log):
        measured = DataLoader(Collecting(n=8), batch_size=2, num_workers=1)
        rate = worker_search._measure(measured, warmup=0, batches=3, max_seconds=60, timeout=60,
                                      clock=StepClock(0.5))  # fmt: skip
        assert rate == 2.0  # all 3 batches came, 0.5 s apart on the clock
        assert not log.exists()
    gc.collect()
    assert log.read_text().split() == [str(os.getpid())]


def _stateful(**settings: Any) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    settings = {"batch_size": 4, **settings}
    return StatefulDataLoader(SlowDataset(n=40), shuffle=True, snapshot_every_n_steps=1,
                              generator=torch.Generator().manual_seed(3), **settings)  # fmt: skip


def test_a_stateful_dataloader_is_built_again_as_itself_and_resumes_mid_epoch() -> None:
    """torchdata's StatefulDataLoader keeps its class, arguments and sampler, so a run
    resumed from a mid-epoch state_dict goes on where it stopped, at the new settings."""
    pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata (test extra)")
    from torchdata.stateful_dataloader import StatefulDataLoader

    # The epoch the user's own loader gives at the tuned settings (a StatefulDataLoader
    # draws from its generator differently with workers than without).
    expected = torch.cat(list(_stateful(num_workers=1, batch_size=8)))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*rebuilt as a torch DataLoader")
        rebuilt = rebuild_dataloader(_stateful(), num_workers=1, batch_size=8)
    assert type(rebuilt) is StatefulDataLoader
    assert (rebuilt.batch_size, rebuilt.num_workers, rebuilt.snapshot_every_n_steps) == (8, 1, 1)
    iterator = iter(rebuilt)
    first = [next(iterator), next(iterator)]
    state = rebuilt.state_dict()
    again = rebuild_dataloader(_stateful(), num_workers=1, batch_size=8)
    again.load_state_dict(state)
    rest = list(again)  # the epoch's remaining batches, from the state
    assert [len(b) for b in first + rest] == [8] * 5
    assert torch.equal(torch.cat(first + rest), expected)


class _NeedsAnArgument(DataLoader):  # type: ignore[type-arg]
    """A subclass with an argument of its own that it keeps nowhere: not recoverable."""

    def __init__(self, dataset: Any, scale: float, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)


class _Plain(DataLoader):  # type: ignore[type-arg]
    pass


def test_a_subclass_is_kept_unless_its_arguments_cannot_be_recovered() -> None:
    dataset = SlowDataset(n=40)
    kept = rebuild_dataloader(_Plain(dataset, batch_size=4), num_workers=1, batch_size=5)
    assert type(kept) is _Plain
    assert (kept.batch_size, kept.num_workers) == (5, 1)
    assert torch.equal(torch.cat(list(kept)), dataset.data)
    with pytest.warns(UserWarning, match="a _NeedsAnArgument, cannot be built again from its"):
        plain = rebuild_dataloader(_NeedsAnArgument(dataset, 2.0, batch_size=4), num_workers=0)
    assert type(plain) is DataLoader
    assert torch.equal(torch.cat(list(plain)), dataset.data)


class _Doubling(DataLoader):  # type: ignore[type-arg]
    """Transforms an argument: built again, it would not be the loader asked for."""

    def __init__(self, dataset: Any, batch_size: int = 1, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=batch_size * 2, **kwargs)


def test_a_subclass_that_transforms_an_argument_gets_exactly_the_tuned_settings() -> None:
    dataset = SlowDataset(n=40)
    with pytest.warns(UserWarning, match="a _Doubling, cannot be built again"):
        rebuilt = rebuild_dataloader(_Doubling(dataset, batch_size=2), num_workers=0, batch_size=8)
    assert rebuilt.batch_size == 8


def test_a_subclass_from_a_hook_is_made_again_as_the_hook_made_it() -> None:
    """Lightning can then build it again around its DistributedSampler, as under DDP."""
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import BatchSampler

    dataset = SlowDataset(n=40)
    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        made = _NeedsAnArgument(dataset, 2.0, batch_size=4)  # as in a *_dataloader hook
    rebuilt = rebuild_dataloader(made, num_workers=1, batch_size=5)
    assert type(rebuilt) is _NeedsAnArgument
    ranks = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=False)
    ranked = _update_dataloader(rebuilt, ranks)
    assert type(ranked) is _NeedsAnArgument
    assert (ranked.batch_size, ranked.num_workers) == (5, 1)
    assert torch.equal(torch.cat(list(ranked)), dataset.data[1::2])


class _Pairs:
    """A batch sampler of the user's that is not a torch BatchSampler."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter([[i, i + 1] for i in range(0, self.n, 2)])

    def __len__(self) -> int:
        return self.n // 2


def test_a_stateful_dataloader_over_a_users_batch_sampler_is_kept() -> None:
    pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata (test extra)")
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset, pairs = SlowDataset(n=40), _Pairs(40)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*rebuilt as a torch DataLoader")
        rebuilt = rebuild_dataloader(StatefulDataLoader(dataset, batch_sampler=pairs),
                                     num_workers=1)  # fmt: skip
    assert type(rebuilt) is StatefulDataLoader
    assert rebuilt.batch_sampler is pairs
    assert torch.equal(torch.cat(list(rebuilt)), dataset.data)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_epoch_shorter_than_the_warm_up_is_timed_over_the_next_epochs(
    num_workers: int, paced: Callable[[Rates], Figures]
) -> None:
    """One batch per epoch: timed over as many epochs as the batches asked for take, not
    reported as a failure (nor timed on one batch its workers made during the warm-up)."""
    loader = DataLoader(SlowDataset(n=3), batch_size=4, num_workers=num_workers,
                        persistent_workers=num_workers > 0)  # fmt: skip
    clock = StepClock(0.5)
    rate = worker_search._measure(loader, warmup=3, batches=4, max_seconds=30, timeout=30,
                                  clock=clock)  # fmt: skip
    assert rate == 1 / 0.5  # a batch every 0.5 s on the clock
    assert clock.readings == 1 + 4  # the 4 batches asked for, from 4 epochs
    paced({0: 8.0, 1: 4.0, (1, 4): 4.0, (2, 2): 4.0})  # each candidate's real batches, paced
    result = tune_num_workers(loader, max_workers=1, batches=2, min_seconds=0.0, cache=False,
                              progress=False)  # fmt: skip
    # The loader as given, then 0 workers (unless that is the loader as given), 1 worker and
    # its deeper prefetch: each timed, none "ran out of batches".
    table = [(row["num_workers"], row["prefetch_factor"], row["skipped"], row["batches_per_sec"])
             for row in result.table]  # fmt: skip
    assert table == [(2, 2, None, 4.0), (0, None, None, 8.0), (1, 2, None, 4.0),
                     (1, 4, None, 4.0)][0 if num_workers else 1 :]  # fmt: skip
