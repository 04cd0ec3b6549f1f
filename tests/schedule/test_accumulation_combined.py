"""AccumulationScheduler on several train loaders at once (Lightning's CombinedLoader).

A step of a dict or a list of loaders trains one batch of each: the micro-batch is
their sum, and the global batch counts every sample that reached an optimizer step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import AccumulationScheduler, SpeedkitConfigError

DIM = 6


def _loader(samples: int, batch_size: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(samples)
    x = torch.randn(samples, DIM, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch_size)


def _prebatched(batches: int, size: int) -> DataLoader[Any]:
    """A loader that says no batch size: its items are batches of ``size`` already."""
    x = torch.randn(batches, size, DIM, generator=torch.Generator().manual_seed(size))
    return DataLoader([(b, b.sum(1, keepdim=True)) for b in x], batch_size=None)


class Counting(L.LightningModule):
    """Trains on every loader's batch of a step; records the samples of each optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(DIM, 1)
        self.pending = 0
        self.per_step: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        parts = list(batch.values()) if isinstance(batch, Mapping) else list(batch)
        parts = [p for p in parts if p is not None]
        self.pending += sum(len(x) for x, _ in parts)
        losses = [torch.nn.functional.mse_loss(self.layer(x), y) for x, y in parts]
        return torch.stack(losses).sum()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.per_step.append(self.pending)
        self.pending = 0

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(callback: AccumulationScheduler, loaders: Any, max_steps: int = 3) -> Counting:
    model = Counting()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, callbacks=[callback],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, loaders)
    return model


def _two(kind: str, first: Any, second: Any) -> Any:
    return {"a": first, "b": second} if kind == "dict" else [first, second]


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_the_micro_batch_is_every_loaders_batch(kind: str) -> None:
    # 8 + 8 samples a micro-batch: 32 is 2 of them, not 4 of the first loader's 8.
    callback = AccumulationScheduler(target_global_batch=32)
    model = _fit(callback, _two(kind, _loader(256, 8), _loader(256, 8)))
    assert [(c.accumulation, c.global_batch) for c in callback.history] == [(2, 32)]
    assert model.per_step == [32, 32, 32]


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_loaders_of_different_batch_sizes(kind: str) -> None:
    callback = AccumulationScheduler(target_global_batch=48)  # 4 micro-batches of 8 + 4
    model = _fit(callback, _two(kind, _loader(256, 8), _loader(128, 4)))
    assert [(c.accumulation, c.global_batch) for c in callback.history] == [(4, 48)]
    assert model.per_step == [48, 48, 48]


@pytest.mark.parametrize("mode", ["max_size_cycle", "min_size"])
def test_a_combined_loader_in_a_mode_that_gives_every_loader_each_step(mode: str) -> None:
    callback = AccumulationScheduler(target_global_batch=36)  # 3 micro-batches of 8 + 4
    loaders = CombinedLoader({"a": _loader(256, 8), "b": _loader(128, 4)}, mode=mode)
    model = _fit(callback, loaders)
    assert [(c.accumulation, c.global_batch) for c in callback.history] == [(3, 36)]
    assert model.per_step == [36, 36, 36]


def test_loaders_without_a_batch_size_are_sized_from_the_first_batch() -> None:
    # batch_size=None: each item is already a batch; 2 + 3 samples a micro-batch.
    callback = AccumulationScheduler(target_global_batch=20)
    model = _fit(callback, {"a": _prebatched(16, 2), "b": _prebatched(16, 3)}, max_steps=2)
    assert [(c.accumulation, c.global_batch) for c in callback.history] == [(4, 20)]
    assert model.per_step == [20, 20]


def test_max_size_mode_is_refused_with_the_fix() -> None:
    callback = AccumulationScheduler(target_global_batch=32)
    loaders = CombinedLoader({"a": _loader(256, 8), "b": _loader(64, 8)}, mode="max_size")
    with pytest.raises(SpeedkitConfigError) as info:
        _fit(callback, loaders)
    message = str(info.value)
    assert "'max_size'" in message
    assert 'mode="max_size_cycle"' in message
