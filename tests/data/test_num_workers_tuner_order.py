"""NumWorkersTuner keeps a seeded run's shuffle in every epoch, persistent workers or not.

A DataLoader draws a base seed for its workers from the global generator each time it
makes an iterator, and a shuffle's seed comes from the same generator; a loader with
persistent workers makes one iterator for the fit. With the tuner's persistent workers,
every epoch from the second on shuffled otherwise than the loader as given (epoch 0 was
the same). Figures are set (``figures``): one persistent worker is the pick.
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


def _fit(data: type[L.LightningDataModule], tuner: NumWorkersTuner | None) -> tuple[Any, int]:
    L.seed_everything(1, verbose=False)
    model = Seen()
    trainer = L.Trainer(accelerator="cpu", max_epochs=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[tuner] if tuner else [])  # fmt: skip
    trainer.fit(model, datamodule=data())
    return dict(model.seen), trainer.train_dataloader.num_workers


@pytest.mark.parametrize("data", [Plain, Speed, SpeedWithPlainLoader])
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
