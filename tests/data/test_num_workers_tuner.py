"""NumWorkersTuner: the pick used in fit, the bottleneck verdict and the spare-cores search,
on set figures and a fake step clock; DDP and a real DataModule."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_speedkit import NumWorkersTuner, SpeedkitConfigError
from lightning_speedkit.data import num_workers_tuner, worker_search
from lightning_speedkit.distributed._hang_report import PAUSED

from ..helpers.models import MLP, SlowDataset, loader
from ..helpers.multiprocess import run_script
from .conftest import Figures


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
    tmp_path: Path, figures: Callable[..., Figures]
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
    tmp_path: Path, figures: Callable[..., Figures]
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


def test_callback_tunes_a_datamodules_loader(
    small_corpus: Path, tmp_path: Path, figures: Callable[..., Figures]
) -> None:
    from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule, VLMTask

    from ..conftest import SMALL_CORPUS

    tok = CaptionTokenizer()
    task = VLMTask(VLMConfig.preset("tiny", tok.vocab_size), pad_id=tok.pad_id)
    dm = VLMDataModule(small_corpus, batch_size=8, corpus=SMALL_CORPUS, progress=False)
    fake = figures({0: 60.0, 1: 58.0, 2: 110.0, (2, 4): 100.0})
    trainer, tuner, _ = _fit_with_tuner(task, None, tmp_path, datamodule=dm)
    assert fake.seen == [(0, None), (1, 2), (2, 2), (2, 4)]
    assert tuner.result is not None
    assert tuner.result.best["num_workers"] == 2
    assert trainer.train_dataloader.num_workers == 2  # type: ignore[union-attr]
    assert trainer.train_dataloader.collate_fn is dm.collate  # type: ignore[union-attr]


def test_mixin_datamodule_builds_with_the_tuned_settings(
    tmp_path: Path, figures: Callable[..., Figures]
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


def _fit_on_two_cores(
    model: L.LightningModule, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mixin: bool = False
) -> tuple[NumWorkersTuner, _Recorder, list[int], list[int]]:
    """Two epochs on a "2-core" CPU rank where torch computes on both cores (the budget at
    setup is 0 workers); the workers the train loader had as each epoch started and ended."""
    monkeypatch.setattr(num_workers_tuner, "cpu_budget", lambda local_world_size=1: 2)
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
    for epoch in samples:  # every sample once an epoch, whatever loaded it
        assert torch.equal(torch.cat(epoch), dataset.data)
    assert trainer.reload_dataloaders_every_n_epochs == 0  # the Trainer's setting, put back
    return tuner, recorder, per_epoch, at_end


@pytest.mark.parametrize("mixin", [False, True], ids=["loader", "mixin-datamodule"])
def test_data_far_behind_the_model_gets_the_cores_the_compute_does_not_need(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, figures: Callable[..., Figures], mixin: bool
) -> None:
    """Issue 20: torch's threads held both cores at setup, so no worker was tried; the
    model then consumed 731 batches/s against the loader's 10.3. The compute needs 0.06
    of a core: workers on both cores are measured and the best is used at once (issue 33)."""
    fake = figures({0: 10.3, 1: 9.0, 2: 24.0, (2, 4): 23.0}, step_s=1 / 731)
    tuner, recorder, per_epoch, at_end = _fit_on_two_cores(MLP(), monkeypatch, tmp_path, mixin)
    assert fake.seen == [(0, None), (0, None), (1, 2), (2, 2), (2, 4)]  # setup, then 2 cores
    assert tuner.bottleneck is not None
    assert tuner.bottleneck["data_bound"] is True
    assert tuner.result is not None
    assert tuner.result.best == {"num_workers": 2, "pin_memory": False,
                                 "persistent_workers": True, "prefetch_factor": 2}  # fmt: skip
    assert tuner.result.pending is None
    assert per_epoch == [0, 2]
    assert at_end == [2, 2]  # switched within the first epoch
    assert recorder.seen["data/num_workers"] == 2.0


@pytest.mark.parametrize(
    ("loader_rate", "model_rate"),
    [(94.0, 34.0), (10.0, 15.0)],
    ids=["demo-not-data-bound", "data-bound-compute-needs-both-cores"],
)
def test_compute_that_needs_every_core_keeps_loading_in_process(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    figures: Callable[..., Figures],
    loader_rate: float,
    model_rate: float,
) -> None:
    """The demo's case: torch's threads need both cores, so nothing more is measured and
    ``num_workers=0`` stays."""
    fake = figures({0: loader_rate, 1: loader_rate * 2, 2: loader_rate * 3}, step_s=1 / model_rate)
    tuner, _, per_epoch, at_end = _fit_on_two_cores(MLP(), monkeypatch, tmp_path)
    assert fake.seen == [(0, None)]  # the loader as given, at setup; nothing after the verdict
    assert tuner.bottleneck is not None
    assert tuner.bottleneck["data_bound"] is (model_rate > loader_rate)
    assert tuner.result is not None
    assert tuner.result.best["num_workers"] == 0
    assert per_epoch == at_end == [0, 0]


def test_compute_threads_share_the_cores_and_are_restored(
    tmp_path: Path, figures: Callable[..., Figures]
) -> None:
    figures(lambda trial: 10.0 * (1 + trial.num_workers))  # more workers: always faster
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
    cores = worker_search.cpu_budget(1)
    assert tuner.result is not None
    assert max(row["num_workers"] for row in tuner.result.table) == max(0, cores - 1)
    assert tuner.result.best["num_workers"] == max(0, cores - 1)
    with pytest.raises(SpeedkitConfigError, match="`compute_threads`"):
        NumWorkersTuner(compute_threads=0)


class Stateful(DataLoader):  # type: ignore[type-arg]
    """A loader of the kind Lightning resumes mid-epoch (it has a state_dict)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_a_choice_of_the_loaders_own_settings_keeps_the_loader(
    figures: Callable[..., Figures],
) -> None:
    figures(lambda trial: 10.0 / (1 + trial.num_workers))  # no worker is the fastest
    given = Stateful(loader(n=64).dataset, batch_size=8)
    tuner = NumWorkersTuner(max_workers=1, batches=4, cache=False, progress=False,
                            verdict_steps=0)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, callbacks=[tuner],
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(MLP(), given)
    assert tuner.result is not None
    assert tuner.result.best["num_workers"] == 0
    assert type(trainer.train_dataloader) is Stateful  # not rebuilt as a plain DataLoader


def test_compute_threads_are_restored_after_a_fit_that_raised(
    tmp_path: Path, figures: Callable[..., Figures]
) -> None:
    figures(lambda trial: 10.0 * (1 + trial.num_workers))
    before = torch.get_num_threads()
    torch.set_num_threads(2)

    class Fails(L.Callback):
        def on_train_start(self, *args: Any) -> None:
            assert torch.get_num_threads() == 1
            raise RuntimeError("stopped")

    tuner = NumWorkersTuner(
        compute_threads=1, batches=4, cache=False, progress=False, verdict_steps=0
    )
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, callbacks=[tuner, Fails()],
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    try:
        with pytest.raises(RuntimeError, match="stopped"):
            trainer.fit(MLP(), loader(n=64))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("kwargs", "argument"), [({"batches": 0}, "batches"), ({"timeout": 0}, "timeout")]
)
def test_callback_refuses_bad_tuning_arguments_at_construction(
    kwargs: dict[str, Any], argument: str
) -> None:
    with pytest.raises(SpeedkitConfigError, match=f"`{argument}`"):
        NumWorkersTuner(**kwargs)


class _Where(torch.utils.data.Dataset[dict[str, int]]):
    """Each sample says which it is and which process loaded it."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"index": i, "pid": os.getpid()}


class _Seen(L.LightningModule):
    """Records each training batch's sample indices, the processes that loaded them and
    the settings of the train loader in use."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.indices: list[int] = []
        self.pids: list[set[int]] = []
        self.workers: list[int] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.indices += batch["index"].tolist()
        self.pids.append(set(batch["pid"].tolist()))
        self.workers.append(self.trainer.train_dataloader.num_workers)  # type: ignore[union-attr]
        return self.weight.sum() * 0.0 + self.weight.pow(2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _one_epoch_on_two_cores(
    monkeypatch: pytest.MonkeyPatch, given: DataLoader[Any]
) -> tuple[NumWorkersTuner, _Seen, L.Trainer]:
    """One epoch of 12 batches on a "2-core" rank whose torch threads hold both cores: the
    verdict comes after batch 7 (3 untimed, 4 timed)."""
    monkeypatch.setattr(num_workers_tuner, "cpu_budget", lambda local_world_size=1: 2)
    torch.set_num_threads(2)  # the test's fixture restores the thread count
    tuner = NumWorkersTuner(batches=4, cache=False, progress=False, verdict_steps=4)
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, callbacks=[tuner],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = _Seen()
    trainer.fit(model, given)
    return tuner, model, trainer


_TWO_WORKERS = {"num_workers": 2, "pin_memory": False, "persistent_workers": True,
                "prefetch_factor": 2}  # fmt: skip


def test_a_one_epoch_fit_switches_to_the_faster_loader_mid_epoch(
    monkeypatch: pytest.MonkeyPatch, figures: Callable[..., Figures]
) -> None:
    """Issue 33: with one epoch, the better loader found by the verdict never arrived and
    ``result.best`` named a loader not in use. Now the rest of the epoch comes from it:
    each sample once, in the epoch's shuffled order, loaded by its two workers."""
    figures({0: 10.3, 1: 9.0, 2: 24.0, (2, 4): 23.0}, step_s=1 / 731)
    torch.manual_seed(3)
    expected = [int(i) for batch in DataLoader(_Where(), batch_size=4, shuffle=True)
                for i in batch["index"]]  # fmt: skip
    torch.manual_seed(3)
    tuner, model, trainer = _one_epoch_on_two_cores(
        monkeypatch, DataLoader(_Where(), batch_size=4, shuffle=True)
    )
    assert model.indices == expected  # every sample exactly once, in the epoch's order
    assert sorted(model.indices) == list(range(48))
    assert model.workers == [0] * 7 + [2] * 5  # the switch after batch 7's verdict
    assert model.pids[:7] == [{os.getpid()}] * 7
    pids = set().union(*model.pids[7:])
    assert len(pids) == 2  # the new loader's two workers
    assert os.getpid() not in pids
    assert trainer.train_dataloader.num_workers == 2  # type: ignore[union-attr]
    assert tuner.result is not None
    assert tuner.result.best == _TWO_WORKERS
    assert tuner.result.best_batches_per_sec == 24.0
    assert tuner.result.pending is None


def test_the_search_mid_fit_is_a_pause_to_hang_watchdog_not_a_hang(
    monkeypatch: pytest.MonkeyPatch, figures: Callable[..., Figures], tmp_path: Path
) -> None:
    """The search for spare cores holds training (every rank, under DDP) for up to its
    time budget: HangWatchdog beside it must not take that for a hung step."""
    from lightning_speedkit import HangWatchdog
    from lightning_speedkit.data import _verdict

    figures({0: 10.3, 1: 9.0, 2: 24.0, (2, 4): 23.0}, step_s=1 / 731)
    watchdog = HangWatchdog(timeout=30.0, dirpath=str(tmp_path))
    now = [0.0]
    watchdog._clock = lambda: now[0]
    phases: list[int] = []
    search = _verdict.search_spare_cores

    def slow_search(*args: Any, **kwargs: Any) -> Any:
        phases.append(watchdog._watch.mark[1])  # type: ignore[index]
        now[0] += 1000.0  # the search takes 1000 s on the watchdog's clock
        return search(*args, **kwargs)

    monkeypatch.setattr(_verdict, "search_spare_cores", slow_search)
    monkeypatch.setattr(num_workers_tuner, "cpu_budget", lambda local_world_size=1: 2)
    torch.set_num_threads(2)  # the test's fixture restores the thread count
    tuner = NumWorkersTuner(batches=4, cache=False, progress=False, verdict_steps=4)
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, callbacks=[tuner, watchdog],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_Seen(), DataLoader(_Where(), batch_size=4))
    assert tuner.result is not None
    assert tuner.result.best == _TWO_WORKERS  # the search ran, and won
    assert phases == [PAUSED]  # unwatched while it ran
    assert max(seconds for _, seconds in watchdog._steps) == 0.0  # not in any step's time
    assert list(tmp_path.iterdir()) == []  # no stacks dumped, no hang report


def test_a_loader_that_cannot_switch_mid_epoch_keeps_result_true_to_it(
    monkeypatch: pytest.MonkeyPatch, figures: Callable[..., Figures]
) -> None:
    """A loader with a state_dict (mid-epoch resume) keeps its workers for the epoch;
    ``result`` names it, with the faster settings pending and why."""
    figures({0: 10.3, 1: 9.0, 2: 24.0, (2, 4): 23.0}, step_s=1 / 731)
    tuner, model, _ = _one_epoch_on_two_cores(monkeypatch, Stateful(_Where(), batch_size=4))
    assert model.indices == list(range(48))
    assert model.workers == [0] * 12
    assert tuner.result is not None
    assert tuner.result.best["num_workers"] == 0
    assert tuner.result.best_batches_per_sec == 10.3
    assert tuner.result.pending == _TWO_WORKERS
    assert tuner.result.pending_reason is not None
    assert tuner.result.pending_reason.startswith(
        "the train loader, a Stateful, saves its place in the epoch for mid-epoch resume"
    )


@pytest.mark.multiprocess
def test_under_ddp_every_rank_switches_mid_epoch_and_every_sample_is_seen_once(
    tmp_path: Path,
) -> None:
    """Rank 0's verdict and search, broadcast: each rank goes on with two workers after its
    7th batch, within Lightning's DistributedSampler share, losing and repeating nothing."""
    ranks = run_script("tuner_switch_ddp.py", tmp_path)
    for rank in ranks:
        assert rank["sampler"] == "DistributedSampler"
        assert rank["workers"] == [0] * 7 + [2] * 5
        assert rank["best"]["num_workers"] == 2
    assert sorted(ranks[0]["indices"] + ranks[1]["indices"]) == list(range(96))


class _OneShot(IterableDataset[torch.Tensor]):
    """64 samples from an iterator opened in ``__init__`` (a queue, a socket, a file read
    once): each iterator of the dataset goes on where the last stopped."""

    def __init__(self) -> None:
        self.src = iter(range(64))

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (torch.tensor([float(i)]) for i in self.src)


class _Reads(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.extend(batch.flatten().tolist())
        return self.layer(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_stream_from_a_source_opened_once_trains_on_every_sample(tmp_path: Path) -> None:
    """The tuner's trials read the stream before training: the fit trained on 0 of its 400
    samples, and nothing said so. It is left untuned now, and the verdict, with no loader
    rate to judge, is not given."""
    tuner = NumWorkersTuner(max_workers=2, batches=4, cache_dir=str(tmp_path / "cache"),
                            progress=False, verdict_steps=2)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, callbacks=[tuner],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = _Reads()
    with pytest.warns(UserWarning, match=r"reads from `src`, an iterator .* untuned"):
        trainer.fit(model, DataLoader(_OneShot(), batch_size=4))
    assert sorted(model.seen) == [float(i) for i in range(64)]  # every sample, once
    assert tuner.result is not None
    assert tuner.result.untuned is not None
    assert tuner.result.table == []
    assert tuner.bottleneck is None  # no verdict against a rate never measured
    assert not (tmp_path / "cache").exists()
