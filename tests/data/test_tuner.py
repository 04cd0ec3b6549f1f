from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

from lightning_speedkit import NumWorkersTuner, SpeedkitConfigError, tune_num_workers
from lightning_speedkit.data import num_workers_tuner as callback_mod
from lightning_speedkit.data import tuner as tuner_mod
from lightning_speedkit.data.tuner import rebuild_dataloader, spare_cores

from ..helpers.models import MLP, SlowDataset, loader
from ..helpers.multiprocess import run_script


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


class _Figures:
    """Set batches/s per candidate in place of timing it: keyed by ``num_workers`` or by
    ``(num_workers, prefetch_factor)``; a candidate with no figure fails as a crashed
    worker does. Usable as ``measure=`` and in place of the tuner's ``_measure``."""

    def __init__(self, rates: dict[Any, float]) -> None:
        self.rates = rates
        self.seen: list[tuple[int, int | None]] = []

    def __call__(self, trial: DataLoader[Any], *timing: Any, **kw: Any) -> float:
        key = (trial.num_workers, trial.prefetch_factor if trial.num_workers else None)
        self.seen.append(key)
        rate = self.rates.get(key, self.rates.get(trial.num_workers))
        if rate is None:
            raise RuntimeError("DataLoader worker (pid 4242) exited unexpectedly")
        return rate


class _Clock:
    """Each reading is ``step_s`` after the last: every training step lasts exactly that."""

    def __init__(self, step_s: float) -> None:
        self.t, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.t += self.step_s
        return self.t


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> Callable[..., _Figures]:
    """In-Trainer tests: candidates get set figures and steps a set duration (no wall clock)."""

    def install(rates: dict[Any, float], step_s: float = 0.001) -> _Figures:
        fake = _Figures(rates)
        monkeypatch.setattr(tuner_mod, "_measure", fake)
        monkeypatch.setattr(callback_mod, "_clock", _Clock(step_s))
        return fake

    return install


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


def test_tuning_consumes_no_randomness_the_user_would_see(tmp_path: Path) -> None:
    original = _user_loader()
    state = original.generator.get_state()  # type: ignore[union-attr]
    expected = _xs(original)
    original.generator.set_state(state)  # type: ignore[union-attr]
    global_state = torch.get_rng_state()
    result = tune_num_workers(original, max_workers=1, batches=3, cache=False, progress=False)
    assert torch.equal(torch.get_rng_state(), global_state)
    assert result.dataloader is not None
    got = _xs(result.dataloader)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_tuning_leaves_a_samplers_own_generator_where_it_was() -> None:
    """A sampler seeded apart from the loader (``RandomSampler(ds, generator=g)``) is
    shared with the trial loaders; its first real epoch must be the one it would have had."""

    def user_loader() -> DataLoader[Any]:
        dataset = SlowDataset(n=60)
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(3))
        return DataLoader(dataset, batch_size=4, sampler=sampler, collate_fn=_collate)

    expected = _xs(user_loader())
    result = tune_num_workers(user_loader(), max_workers=1, batches=3, cache=False, progress=False)
    assert result.dataloader is not None
    got = _xs(result.dataloader)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_slow_dataset_gets_more_workers_and_a_real_speedup(tmp_path: Path) -> None:
    slow = loader(n=400, batch_size=4, delay=0.004)  # 16 ms a batch in one process
    result = tune_num_workers(slow, max_workers=2, batches=15, cache=False, progress=False)
    assert result.best["num_workers"] == 2
    assert result.given_batches_per_sec is not None
    assert result.best_batches_per_sec > 1.5 * result.given_batches_per_sec
    tried = [(row["num_workers"], row["given"]) for row in result.table]
    assert tried[0] == (0, True)
    assert (2, False) in tried
    assert all(row["batches_per_sec"] for row in result.table)


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
    dataset: Dataset[Any], context: str | None, reason: str
) -> None:
    workers = 1 if context else 0  # a multiprocessing context needs workers
    bad = DataLoader(dataset, batch_size=4, num_workers=workers, multiprocessing_context=context)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = tune_num_workers(
            bad, max_workers=2, batches=3, timeout=2, cache=False, progress=False
        )
    assert time.perf_counter() - start < 60  # never hangs
    assert result.best["num_workers"] == 0
    skipped = [row for row in result.table if row["skipped"]]
    assert skipped
    assert all(reason in row["skipped"] for row in skipped)
    assert all(row["num_workers"] > 0 for row in skipped)
    assert any(reason in str(w.message) for w in caught)
    assert result.dataloader is not None
    assert len(list(result.dataloader)) == 16  # and the data is all there


def test_results_are_cached_and_force_retunes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dl = loader(n=64)
    first = tune_num_workers(dl, max_workers=1, batches=3, cache_dir=tmp_path, progress=False)
    assert not first.cached
    assert list(tmp_path.glob("*.json"))

    def no_measuring(*args: Any, **kwargs: Any) -> float:
        raise AssertionError("measured although cached")

    monkeypatch.setattr(tuner_mod, "_measure", no_measuring)
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
    measure = _Figures({0: 10.0, 1: 11.0, (1, 4): 11.0})
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


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"batches": 0}, "batches"), ({"max_workers": -1}, "max_workers"),
     ({"time_budget": 0}, "time_budget"), ({"local_world_size": 0}, "local_world_size")],
)  # fmt: skip
def test_bad_arguments_name_themselves(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(SpeedkitConfigError, match=f"`{argument}`"):
        tune_num_workers(loader(), progress=False, cache=False, **kwargs)


class _Recorder(L.pytorch.loggers.CSVLogger):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.seen: dict[str, float] = {}

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.seen.update(metrics)
        super().log_metrics(metrics, step)


def _fit_with_tuner(
    model: L.LightningModule, train: Any, tmp_path: Path, **kw: Any
) -> tuple[L.Trainer, NumWorkersTuner, _Recorder]:
    tuner = NumWorkersTuner(max_workers=2, batches=12, cache=False, progress=False, verdict_steps=8)
    recorder = _Recorder(tmp_path)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=14, logger=recorder, callbacks=[tuner],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, train, **kw)
    return trainer, tuner, recorder


def test_callback_rebuilds_a_plain_loader_and_finds_the_data_bottleneck(
    tmp_path: Path, figures: Callable[..., _Figures]
) -> None:
    figures({0: 60.0, 1: 58.0, 2: 110.0, (2, 4): 100.0}, step_s=0.001)
    trainer, tuner, recorder = _fit_with_tuner(MLP(), loader(n=600, batch_size=4), tmp_path)
    assert tuner.result is not None
    assert tuner.result.best["num_workers"] == 2
    assert trainer.train_dataloader.num_workers == 2  # type: ignore[union-attr]
    assert recorder.seen["data/num_workers"] == 2.0
    assert recorder.seen["data/loader_batches_per_sec"] == 110.0
    assert tuner.bottleneck is not None
    assert tuner.bottleneck["data_bound"] is True
    assert tuner.bottleneck["model_batches_per_sec"] == pytest.approx(1000.0)


def test_a_compute_bound_run_is_not_blamed_on_data(
    tmp_path: Path, figures: Callable[..., _Figures]
) -> None:
    figures({0: 300.0, 1: 290.0, 2: 400.0, (2, 4): 380.0}, step_s=0.03)
    _, tuner, recorder = _fit_with_tuner(MLP(), loader(n=600, batch_size=4), tmp_path)
    assert tuner.bottleneck is not None
    assert tuner.bottleneck["data_bound"] is False
    assert recorder.seen["data/model_batches_per_sec"] == pytest.approx(1 / 0.03)  # 30 ms a step


@pytest.mark.multiprocess
def test_ddp_keeps_lightnings_distributed_sampler_and_every_sample(tmp_path: Path) -> None:
    # Each rank measures its own (a close call can go either way on a busy machine); rank
    # 0's choice is the one every rank uses.
    ranks = run_script("tuner_ddp.py", tmp_path / "plain", "--mode", "plain")
    for rank in ranks:
        assert rank["sampler"] == "DistributedSampler"
        assert rank["num_workers"] == ranks[0]["tuned_num_workers"]
    seen = [set(r["plain_indices"]) for r in ranks]
    assert seen[0].isdisjoint(seen[1])
    assert len(seen[0] | seen[1]) == 64
    ranks = run_script("tuner_ddp.py", tmp_path / "bucketed", "--mode", "bucketed")
    assert all(r["num_workers"] == ranks[0]["tuned_num_workers"] for r in ranks)
    bucketed = [r["bucketed_indices"] for r in ranks]
    assert set(bucketed[0]).isdisjoint(bucketed[1])
    assert sorted(bucketed[0] + bucketed[1]) == list(range(50))  # every sample exactly once


def test_callback_tunes_a_datamodules_loader(small_corpus: Path, tmp_path: Path) -> None:
    from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule, VLMTask

    from ..conftest import SMALL_CORPUS

    tok = CaptionTokenizer()
    task = VLMTask(VLMConfig.preset("tiny", tok.vocab_size), pad_id=tok.pad_id)
    dm = VLMDataModule(small_corpus, batch_size=8, corpus=SMALL_CORPUS, progress=False)
    trainer, tuner, _ = _fit_with_tuner(task, None, tmp_path, datamodule=dm)
    assert tuner.result is not None
    assert trainer.train_dataloader.num_workers == tuner.result.best["num_workers"]  # type: ignore[union-attr]
    assert trainer.train_dataloader.collate_fn is dm.collate  # type: ignore[union-attr]


def test_mixin_datamodule_builds_with_the_tuned_settings(
    tmp_path: Path, figures: Callable[..., _Figures]
) -> None:
    from lightning_speedkit import SpeedDataModuleMixin

    class Data(SpeedDataModuleMixin, L.LightningDataModule):
        calls = 0

        def train_dataloader(self) -> DataLoader[Any]:
            Data.calls += 1
            return self.speed_dataloader(SlowDataset(n=600), batch_size=4, num_workers=0)

    figures({0: 60.0, 1: 58.0, 2: 110.0, (2, 4): 100.0})
    dm = Data()
    trainer, tuner, _ = _fit_with_tuner(MLP(), None, tmp_path, datamodule=dm)
    assert tuner.result is not None
    assert tuner.result.best["num_workers"] == 2
    assert dm.speed_loader_kwargs == tuner.result.best
    assert trainer.train_dataloader.num_workers == 2  # type: ignore[union-attr]
    assert Data.calls == 2  # once to tune, once by Lightning with the tuned settings


def test_one_worker_beats_loading_in_the_training_process() -> None:
    """Alone, one worker decodes no faster than the main process; it wins by overlapping
    with training, so within the noise band (``min_gain``) of the in-process rate the
    tuner prefers it."""
    measure = _Figures({0: 10.0, 1: 9.6, (1, 4): 9.7})  # 4% slower: noise
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
                              measure=_Figures(rates))  # fmt: skip
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


def _fit_on_two_cores(
    model: L.LightningModule, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mixin: bool = False
) -> tuple[NumWorkersTuner, _Recorder, list[int]]:
    """Two epochs on a "2-core" CPU rank where torch computes on both cores (the budget at
    setup is 0 workers); the workers each epoch's loader had."""
    monkeypatch.setattr(callback_mod, "cpu_budget", lambda local_world_size=1: 2)
    torch.set_num_threads(2)  # the test's fixture restores the thread count
    per_epoch: list[int] = []
    at_end: list[int] = []
    samples: list[list[torch.Tensor]] = []

    class Workers(L.Callback):
        def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
            per_epoch.append(trainer.train_dataloader.num_workers)  # type: ignore[union-attr]
            samples.append([])

        def on_train_batch_end(self, trainer: L.Trainer, module: Any, out: Any, batch: Any,
                               *args: Any) -> None:  # fmt: skip
            samples[-1].append(batch)

        def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
            at_end.append(trainer.train_dataloader.num_workers)  # type: ignore[union-attr]

    tuner = NumWorkersTuner(batches=4, cache=False, progress=False, verdict_steps=4)
    recorder = _Recorder(tmp_path)
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=2, logger=recorder, callbacks=[tuner, Workers()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    dataset = SlowDataset(n=48)  # 12 batches an epoch
    if mixin:
        from lightning_speedkit import SpeedDataModuleMixin

        class Data(SpeedDataModuleMixin, L.LightningDataModule):
            def train_dataloader(self) -> DataLoader[Any]:
                return self.speed_dataloader(dataset, batch_size=4)

        trainer.fit(model, datamodule=Data())
    else:
        trainer.fit(model, DataLoader(dataset, batch_size=4))
    assert at_end == per_epoch  # a switch waits for the next epoch; the loader is always there
    for epoch in samples:  # every sample once an epoch, whatever loaded it
        assert torch.equal(torch.cat(epoch), dataset.data)
    assert trainer.reload_dataloaders_every_n_epochs == 0  # the Trainer's setting, put back
    return tuner, recorder, per_epoch


@pytest.mark.parametrize("mixin", [False, True], ids=["loader", "mixin-datamodule"])
def test_data_far_behind_the_model_gets_the_cores_the_compute_does_not_need(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, figures: Callable[..., _Figures], mixin: bool
) -> None:
    """Issue 20: torch's threads held both cores at setup, so no worker was tried; the
    model then consumed 731 batches/s against the loader's 10.3. The compute needs 0.06
    of a core: workers on both cores are measured and the best is used next epoch."""
    fake = figures({0: 10.3, 1: 9.0, 2: 24.0, (2, 4): 23.0}, step_s=1 / 731)
    tuner, recorder, per_epoch = _fit_on_two_cores(MLP(), monkeypatch, tmp_path, mixin)
    assert fake.seen == [(0, None), (0, None), (1, 2), (2, 2), (2, 4)]  # setup, then 2 cores
    assert tuner.bottleneck is not None
    assert tuner.bottleneck["data_bound"] is True
    assert tuner.result is not None
    assert tuner.result.best == {"num_workers": 2, "pin_memory": False,
                                 "persistent_workers": True, "prefetch_factor": 2}  # fmt: skip
    assert per_epoch == [0, 2]
    assert recorder.seen["data/num_workers"] == 2.0


@pytest.mark.parametrize(
    ("loader_rate", "model_rate"),
    [(94.0, 34.0), (10.0, 15.0)],
    ids=["demo-not-data-bound", "data-bound-compute-needs-both-cores"],
)
def test_compute_that_needs_every_core_keeps_loading_in_process(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    figures: Callable[..., _Figures],
    loader_rate: float,
    model_rate: float,
) -> None:
    """The demo's case: torch's threads need both cores, so nothing more is measured and
    ``num_workers=0`` stays."""
    fake = figures({0: loader_rate, 1: loader_rate * 2, 2: loader_rate * 3}, step_s=1 / model_rate)
    tuner, _, per_epoch = _fit_on_two_cores(MLP(), monkeypatch, tmp_path)
    assert fake.seen == [(0, None)]  # the loader as given, at setup; nothing after the verdict
    assert tuner.bottleneck is not None
    assert tuner.bottleneck["data_bound"] is (model_rate > loader_rate)
    assert tuner.result is not None
    assert tuner.result.best["num_workers"] == 0
    assert per_epoch == [0, 0]


def test_compute_threads_share_the_cores_and_are_restored(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    seen: list[int] = []

    class Threads(L.Callback):
        def on_train_start(self, *args: Any) -> None:
            seen.append(torch.get_num_threads())

    tuner = NumWorkersTuner(
        compute_threads=1, batches=4, cache=False, progress=False, verdict_steps=0
    )
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, callbacks=[tuner, Threads()],
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(MLP(), loader(n=64))
    assert seen == [1]
    assert torch.get_num_threads() == before
    cores = tuner_mod.cpu_budget(1)
    assert tuner.result is not None
    assert max(row["num_workers"] for row in tuner.result.table) == max(0, cores - 1)
    with pytest.raises(SpeedkitConfigError, match="`compute_threads`"):
        NumWorkersTuner(compute_threads=0)


@pytest.mark.parametrize(
    ("kwargs", "argument"), [({"batches": 0}, "batches"), ({"timeout": 0}, "timeout")]
)
def test_callback_refuses_bad_tuning_arguments_at_construction(
    kwargs: dict[str, Any], argument: str
) -> None:
    with pytest.raises(SpeedkitConfigError, match=f"`{argument}`"):
        NumWorkersTuner(**kwargs)


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
    rate = tuner_mod._measure(_user_loader(num_workers=2), warmup=1, batches=4,
                              max_seconds=30, timeout=10)  # fmt: skip
    assert rate > 0
    assert terminated == []
