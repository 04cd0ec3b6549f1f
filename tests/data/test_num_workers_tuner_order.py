"""NumWorkersTuner keeps a seeded run's shuffle in every epoch, persistent workers or not.

A DataLoader draws a base seed for its workers from the global generator each time it
makes an iterator, and a shuffle's seed comes from the same generator; a loader with
persistent workers makes one iterator for the fit. With the tuner's persistent workers,
every epoch from the second on shuffled otherwise than the loader as given (epoch 0 was
the same). Figures are set (``figures``): one persistent worker is the pick.

A shuffle with a generator of its own (``DataLoader(shuffle=True, generator=g)``) also
draws from ``g`` as its sampler is asked past its end, which workers asking ahead do each
epoch and Lightning, stopping an in-process loader at its length, never does; and a
loader switched to other workers in the middle of an epoch made a new iterator (a base
seed) where the given loader's persistent one made none.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit import NumWorkersTuner, SpeedDataModuleMixin

RATES = {0: 10.0, 1: 30.0}  # one worker (persistent) wins


class Numbers(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index)])


class Plain(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Numbers(), batch_size=8, shuffle=True)


class PlainSeeded(L.LightningDataModule):
    """A shuffle with a generator of its own, made in the hook (each call a fresh one)."""

    def train_dataloader(self) -> DataLoader[Any]:
        own = torch.Generator().manual_seed(5)
        return DataLoader(Numbers(), batch_size=8, shuffle=True, generator=own)


class SpeedSeeded(SpeedDataModuleMixin, L.LightningDataModule):
    def train_dataloader(self) -> DataLoader[Any]:
        own = torch.Generator().manual_seed(5)
        return self.speed_dataloader(Numbers(), batch_size=8, shuffle=True, generator=own)


class Speed(SpeedDataModuleMixin, L.LightningDataModule):
    def train_dataloader(self) -> DataLoader[Any]:
        return self.speed_dataloader(Numbers(), batch_size=8, shuffle=True)


class SpeedWithPlainLoader(SpeedDataModuleMixin, Plain):
    """The mixin, but a hook that builds its own DataLoader: the tuned settings were set
    aside for ``speed_dataloader`` and never reached it (it trained with 0 workers)."""


class Seen(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: dict[int, list[list[int]]] = collections.defaultdict(list)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen[self.current_epoch].append(batch.flatten().int().tolist())
        return self.layer(batch).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(
    data: type[L.LightningDataModule] | Callable[[], DataLoader[Any]],
    tuner: NumWorkersTuner | None,
    callbacks: tuple[L.Callback, ...] = (),
) -> tuple[Any, int]:
    """Three seeded epochs: each epoch's batches, and the train loader's workers at the end.
    ``data``: a DataModule class, or a function giving the loader passed to ``fit``."""
    L.seed_everything(1, verbose=False)
    model = Seen()
    trainer = L.Trainer(accelerator="cpu", max_epochs=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[*callbacks, *([tuner] if tuner else [])])  # fmt: skip
    if isinstance(data, type):
        trainer.fit(model, datamodule=data())
    else:
        trainer.fit(model, data())
    return dict(model.seen), trainer.train_dataloader.num_workers


def _seeded_loader(**kw: Any) -> DataLoader[Any]:
    own = torch.Generator().manual_seed(5)
    return DataLoader(Numbers(), batch_size=8, shuffle=True, generator=own, **kw)


@pytest.mark.parametrize("data", [Plain, Speed, SpeedWithPlainLoader, PlainSeeded, SpeedSeeded,
                                  _seeded_loader])  # fmt: skip
def test_every_epoch_shuffles_as_the_loader_as_given(
    data: type[L.LightningDataModule], figures: Callable[..., Any]
) -> None:
    figures(RATES)
    plain, _ = _fit(data, None)
    tuner = NumWorkersTuner(max_workers=1, cache=False, progress=False, verdict_steps=0)
    tuned, workers = _fit(data, tuner)
    assert tuner.result is not None
    assert tuner.result.best["persistent_workers"] is True
    assert workers == 1  # the tuned loader trained
    assert tuned == plain  # all three epochs
    assert plain[1] != plain[0]  # a shuffle that changes by epoch


def test_a_persistent_worker_given_and_loading_in_process_picked_keep_the_shuffle(
    figures: Callable[..., Any],
) -> None:
    """The other way round: the loader as given has a persistent worker (one iterator, one
    base seed, for the fit; its sampler run past its end each epoch), and the tuner picks
    loading in the training process (an iterator an epoch, stopped at the epoch's length)."""
    figures({0: 30.0, 1: 10.0})  # in-process wins

    def given() -> DataLoader[Any]:
        return _seeded_loader(num_workers=1, persistent_workers=True)

    plain, _ = _fit(given, None)
    tuner = NumWorkersTuner(max_workers=1, cache=False, progress=False, verdict_steps=0)
    tuned, workers = _fit(given, tuner)
    assert workers == 0  # the tuned loader trained
    assert tuned == plain
    assert plain[1] != plain[0]


class _Workers(L.Callback):
    """The train loader's workers at each training batch."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.seen.append(trainer.train_dataloader.num_workers)  # type: ignore[union-attr]


@pytest.mark.parametrize("seeded", [False, True], ids=["global", "own generator"])
def test_a_switch_in_the_middle_of_an_epoch_keeps_the_next_epochs_shuffle(
    figures: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, seeded: bool
) -> None:
    """A given loader with a persistent worker, switched to two after the verdict (7th
    batch of 10): the loader the next epochs train on made its first iterator, and drew a
    base seed, where the given loader reused its own. The tuned run's second epoch had the
    untuned run's third epoch's order."""
    from lightning_speedkit.data import num_workers_tuner

    figures({0: 9.0, (1, 3): 10.3, 1: 9.0, 2: 24.0, (2, 4): 23.0}, step_s=1 / 731)
    monkeypatch.setattr(num_workers_tuner, "cpu_budget", lambda local_world_size=1: 2)

    def given() -> DataLoader[Any]:
        own = torch.Generator().manual_seed(5) if seeded else None
        return DataLoader(Numbers(), batch_size=4, shuffle=True, generator=own, num_workers=1,
                          persistent_workers=True, prefetch_factor=3)  # fmt: skip

    plain, _ = _fit(given, None)
    torch.set_num_threads(2)  # torch holds both cores: no worker at setup (the fixture restores)
    workers = _Workers()
    tuner = NumWorkersTuner(batches=4, cache=False, progress=False, verdict_steps=4)
    tuned, _ = _fit(given, tuner, (workers,))
    assert workers.seen == [1] * 7 + [2] * 23  # the given loader, then two workers from batch 8
    assert tuned == plain  # all three epochs
    assert plain[1] != plain[0]
