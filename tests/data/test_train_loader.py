"""Giving the train loader the tuned settings, and a switch that waits for the next epoch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, RandomSampler, Sampler

from lightning_speedkit import NumWorkersTuner, _compat
from lightning_speedkit.data._epoch_draws import UntunedDraws, adopt
from lightning_speedkit.data._train_loader import NextEpochSwitch, with_settings
from lightning_speedkit.data.tune_result import TuneResult

from ..helpers.models import SlowDataset


def test_a_loader_is_rebuilt_only_when_its_settings_differ() -> None:
    given = DataLoader(SlowDataset(n=16), batch_size=4)
    same = {"num_workers": 0, "pin_memory": False}
    assert with_settings(given, same) is given
    rebuilt = with_settings(given, {"num_workers": 2, "prefetch_factor": 4})
    assert (rebuilt.num_workers, rebuilt.prefetch_factor) == (2, 4)
    assert rebuilt.sampler is given.sampler
    other = [given]  # not a single DataLoader: left as it is
    assert with_settings(other, {"num_workers": 2}) is other


def test_a_waiting_loader_is_handed_over_when_the_next_epoch_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []

    def reload_next_epoch(trainer: Any) -> Any:
        events.append("reload")
        return lambda: events.append("restored")

    monkeypatch.setattr(_compat, "reload_train_loader_next_epoch", reload_next_epoch)
    switch = NextEpochSwitch()
    found = TuneResult({"num_workers": 2}, [], 24.0)
    switch.epoch_ended(trainer=None)  # nothing waits: the loop is left alone
    assert switch.epoch_started() is None
    assert events == []
    switch.wait(found)
    switch.epoch_ended(trainer=None)
    switch.epoch_ended(trainer=None)  # once only
    assert events == ["reload"]
    assert switch.epoch_started() is found
    assert events == ["reload", "restored"]
    assert switch.epoch_started() is None  # handed over once


def test_a_fit_that_ends_before_the_next_epoch_puts_the_setting_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    monkeypatch.setattr(_compat, "reload_train_loader_next_epoch",
                        lambda trainer: lambda: events.append("restored"))  # fmt: skip
    switch = NextEpochSwitch()
    switch.wait(TuneResult({"num_workers": 2}, [], 24.0))
    switch.epoch_ended(trainer=None)
    switch.restore()  # teardown
    switch.restore()
    assert events == ["restored"]
    switch.forget()
    assert switch.waiting is None


class _Lazy(Sampler[int]):
    """Draws from its generator one number per index, as it goes (not a permutation up
    front): how far its iterator is asked decides how much it draws."""

    def __init__(self, n: int, generator: torch.Generator) -> None:
        self.n, self.generator = n, generator

    def __iter__(self) -> Iterator[int]:
        for _ in range(self.n):
            yield int(torch.randint(0, self.n, (1,), generator=self.generator))

    def __len__(self) -> int:
        return self.n


def _epochs(loader: DataLoader[Any], epochs: int, batches: int, *, ahead: int = 0,
            draws: UntunedDraws | None = None) -> list[list[list[int]]]:  # fmt: skip
    """Each epoch's batches of indices: the sampler asked ``ahead`` batches past those
    trained (workers asking ahead), a base seed drawn only by the first iterator when
    ``draws`` stands for the untuned loader's, else one an epoch (in-process)."""
    seen = []
    for epoch in range(epochs):
        if draws is None or epoch == 0:
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        order = iter(loader.batch_sampler)  # type: ignore[arg-type]
        asked = [next(order, None) for _ in range(batches + ahead)]
        seen.append([list(batch) for batch in asked[:batches] if batch is not None])
        if draws is not None:
            draws.epoch_ended(loader, batches)
    return seen


@pytest.mark.parametrize(
    "sampler",
    [
        lambda g: RandomSampler(range(40), generator=g),
        lambda g: RandomSampler(range(40), replacement=True, num_samples=40, generator=g),
        lambda g: _Lazy(40, g),
    ],
    ids=["permutation", "with-replacement", "draws-as-it-goes"],
)
@pytest.mark.parametrize("batches", [5, 3], ids=["epoch", "limit_train_batches"])
def test_the_tuned_loaders_epochs_draw_the_given_loaders_shuffles(
    sampler: Any, batches: int
) -> None:
    """Given in-process (an iterator an epoch, stopped at the batches trained) and tuned to
    a persistent worker (one iterator, the sampler asked 3 batches further): whatever the
    sampler draws from its generator, the epochs are the given loader's."""
    g = torch.Generator().manual_seed(5)
    given: DataLoader[Any] = DataLoader(range(40), batch_size=8, sampler=sampler(g), generator=g)
    untuned = _epochs(given, epochs=3, batches=batches)
    g.manual_seed(5)
    draws = UntunedDraws(given)
    tuned = adopt(DataLoader(range(40), batch_size=8, sampler=given.sampler, generator=g,
                             num_workers=1, persistent_workers=True))  # fmt: skip
    assert _epochs(tuned, epochs=3, batches=batches, ahead=3, draws=draws) == untuned
    assert untuned[1] != untuned[0]
    assert tuned.generator is not g  # its later iterators' base seeds: its own generator


class _Indices(L.LightningModule):
    """Records each batch's sample indices and the train loader's workers."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[tuple[int, list[int], int]] = []  # (epoch, indices, workers)

    def train_dataloader(self) -> Any:
        return self.make()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        workers = self.trainer.train_dataloader.num_workers  # type: ignore[union-attr]
        self.seen.append((self.current_epoch, batch.tolist(), workers))
        return self.layer(batch.float()[:, None]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_stateful_loader_resumes_with_its_checkpoints_workers_then_switches(
    tmp_path: Path, figures: Callable[..., Any]
) -> None:
    """A StatefulDataLoader checkpointed mid-epoch with one worker, resumed where the tuner
    picks loading in-process (another machine, ``force=True``, ``cache=False``): torchdata
    refused the state (``AssertionError: State doesn't contain key '_num_yielded'``) and the
    fit crashed. The resumed epoch keeps one worker and the checkpoint's place; the next
    epoch trains in-process."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def loader() -> Any:
        return stateful.StatefulDataLoader(list(range(32)), batch_size=4, num_workers=1)

    common: dict[str, Any] = dict(accelerator="cpu", logger=False, enable_progress_bar=False,
                                  enable_model_summary=False)  # fmt: skip
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    L.Trainer(max_steps=3, callbacks=[every], **common).fit(_Indices(loader))
    (path,) = tmp_path.glob("*.ckpt")
    figures({0: 30.0, 1: 10.0})  # in-process is the pick
    tuner = NumWorkersTuner(max_workers=1, cache=False, progress=False, verdict_steps=0)
    trainer = L.Trainer(max_epochs=2, callbacks=[tuner], enable_checkpointing=False, **common)
    model = _Indices(loader)
    trainer.fit(model, ckpt_path=str(path))
    assert tuner.result is not None
    assert tuner.result.best["num_workers"] == 0
    first = [i for epoch, batch, _ in model.seen if epoch == 0 for i in batch]
    assert first == list(range(12, 32))  # the rest of the epoch, from the checkpoint's place
    assert [w for epoch, _, w in model.seen if epoch == 0] == [1] * 5  # the checkpoint's worker
    assert [w for epoch, _, w in model.seen if epoch == 1] == [0] * 8  # then the tuned loader
    assert [i for epoch, b, _ in model.seen if epoch == 1 for i in b] == list(range(32))
    assert trainer.reload_dataloaders_every_n_epochs == 0  # the Trainer's setting, put back


def test_a_mixin_hook_runs_once_more_with_the_tuner_as_the_docs_say(
    figures: Callable[..., Any],
) -> None:
    """docs/data.md: once at setup, to be measured, and once for the fit loop with the
    tuned settings; later reloads once each, as without the tuner (3 epochs, reloading
    each: 4 calls against 3)."""
    from lightning_speedkit import SpeedDataModuleMixin

    class Data(SpeedDataModuleMixin, L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.built: list[dict[str, Any]] = []  # the tuned settings each call saw

        def train_dataloader(self) -> DataLoader[Any]:
            self.built.append(dict(getattr(self, "speed_loader_kwargs", None) or {}))
            return self.speed_dataloader(list(range(16)), batch_size=4, collate_fn=torch.tensor)

    figures({0: 10.0, 1: 30.0})

    def calls(tuner: NumWorkersTuner | None) -> list[dict[str, Any]]:
        data = Data()
        trainer = L.Trainer(accelerator="cpu", max_epochs=3, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, reload_dataloaders_every_n_epochs=1,
                            callbacks=[tuner] if tuner else [])  # fmt: skip
        trainer.fit(_Indices(lambda: None), datamodule=data)
        return data.built

    assert len(calls(None)) == 3
    tuned = calls(NumWorkersTuner(max_workers=1, cache=False, progress=False, verdict_steps=0))
    assert [call.get("num_workers") for call in tuned] == [None, 1, 1, 1]
