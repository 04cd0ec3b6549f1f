"""FrozenFeatureCache with MicroBatchTuner, in either order: the tuner's trials get the
batch as ``training_step`` gets it in training (the cache's index field taken out), the
cache neither serves nor stores anything of the trials, the tuned loader still carries
the index, and the losses are bit for bit a plain run's at the tuned micro-batch."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit._surgery import side_run
from lightning_speedkit.compute._frozen_loader import INDEX_FIELD, IndexTaker, SampleIndex
from lightning_speedkit.compute._step_timer import StepMeasurement
from lightning_speedkit.compute.frozen_feature_cache import (
    FrozenFeatureCache,
    cache_frozen_features,
)
from lightning_speedkit.compute.micro_batch_tuner import MicroBatchTuner, tune_micro_batch
from lightning_speedkit.schedule.accumulation_scheduler import AccumulationScheduler

SAMPLES, GIVEN, TUNED, GLOBAL, EPOCHS = 48, 8, 4, 16, 3
BATCHES = SAMPLES // TUNED  # per epoch, at the tuned micro-batch


class _Samples(Dataset[Any]):
    """The same sample for an index in every epoch, as a dict or a tuple."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> Any:
        x = torch.randn(12, generator=torch.Generator().manual_seed(index))
        y = torch.tensor(index % 2)
        return {"x": x, "y": y} if self.kind == "dict" else (x, y)


class _Task(L.LightningModule):
    """A frozen tower and a trained head; the losses, and the rows the tower ran on once
    training started (the tuner's trials run it too, before)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.tower = nn.Sequential(nn.Linear(12, 16), nn.Tanh()).requires_grad_(False)
        self.head = nn.Linear(16, 2)
        self.losses: list[torch.Tensor] = []
        self.rows: list[int] = []
        self.types: list[type] = []  # of each batch: as the collate_fn made it
        self.tower_rows: list[int] = []
        self.tower[0].register_forward_pre_hook(self._count)
        self._training = False

    def _count(self, module: nn.Module, args: Any) -> None:
        if self._training:
            self.tower_rows.append(args[0].shape[0])

    def on_train_start(self) -> None:
        self._training = True

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.kind == "dict":
            if set(batch) != {"x", "y"}:
                raise TypeError(f"training_step got the fields {sorted(batch)}")
            x, y = batch["x"], batch["y"]
        else:
            x, y = batch  # three items (the index still in): ValueError
        loss = F.cross_entropy(self.head(self.tower(x)), y)
        if self._training:
            self.losses.append(loss.detach().clone())
            self.rows.append(len(x))
            self.types.append(type(batch))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def _fit(
    kind: str, batch_size: int, callbacks: list[L.Callback], reload: int = 0, **trainer: Any
) -> _Task:
    L.seed_everything(0, verbose=False)
    task = _Task(kind)
    L.Trainer(
        max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        reload_dataloaders_every_n_epochs=reload, callbacks=callbacks, **trainer,
    ).fit(task, DataLoader(_Samples(kind), batch_size=batch_size, shuffle=True))  # fmt: skip
    return task


@functools.cache
def _plain(kind: str, reload: int) -> _Task:
    """No cache, no tuner: the tuned micro-batch and its accumulation set by hand."""
    return _fit(kind, TUNED, [], reload, accumulate_grad_batches=GLOBAL // TUNED)


def _fastest_at(best: int) -> Callable[[Callable[[], None], int], StepMeasurement]:
    """A measure that runs the step once and makes ``best`` the fastest per sample."""

    def measure(run: Callable[[], None], n: int) -> StepMeasurement:
        run()
        return StepMeasurement(0.001 if n == best else 0.004)

    return measure


@pytest.mark.parametrize(
    ("kind", "order", "reload"),
    [
        ("dict", "cache_first", 0),
        ("dict", "tuner_first", 0),
        ("tuple", "cache_first", 0),
        ("tuple", "tuner_first", 0),
        ("dict", "tuner_first", 1),  # each epoch's loader requested again: indexed and resized
    ],
)
def test_the_tuned_fit_serves_the_tower_with_the_plain_losses(
    kind: str, order: str, reload: int
) -> None:
    cache = FrozenFeatureCache(modules=["tower"])
    tuner = MicroBatchTuner(candidates=[TUNED, GIVEN], measure=_fastest_at(TUNED), verbose=False)
    tuning: list[L.Callback] = [AccumulationScheduler(target_global_batch=GLOBAL), tuner]
    callbacks = [cache, *tuning] if order == "cache_first" else [*tuning, cache]
    task = _fit(kind, GIVEN, callbacks, reload)
    plain = _plain(kind, reload)
    assert tuner.result is not None
    assert tuner.result.best == {"batch_size": TUNED}
    assert task.rows == plain.rows == [TUNED] * BATCHES * EPOCHS
    assert task.types == plain.types
    assert all(torch.equal(a, b) for a, b in zip(task.losses, plain.losses, strict=True))
    counts = cache.counts
    # Epoch 0 runs and stores every sample; epoch 1's first batch runs again (a miss) to
    # verify, the rest of epoch 1 and all of epoch 2 are served. No trial counts.
    assert (counts["misses"], counts["stored"]) == (SAMPLES + TUNED, SAMPLES)
    assert counts["hits"] == SAMPLES * (EPOCHS - 1) - TUNED
    assert counts["plain_calls"] == 0
    assert counts["stood_down"] == {}
    assert task.tower_rows == [TUNED] * (BATCHES + 1)


def test_tune_micro_batch_inside_a_cached_step_neither_stores_nor_counts_its_trials() -> None:
    """Trials run under the step's keys would store features of the trials' rows under the
    step's samples (another size, other samples): they run beside the store instead."""
    model = nn.Sequential(nn.Linear(12, 16).requires_grad_(False), nn.Linear(16, 2))
    cache = cache_frozen_features(model, modules=["0"], verify=False)
    loader = DataLoader(_Samples("tuple"), batch_size=GIVEN)

    def step(batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    with cache.keys(range(GIVEN)):
        result = tune_micro_batch(model, loader, step, candidates=[TUNED, GIVEN],
                                  measure=_fastest_at(TUNED), global_batch=GLOBAL)  # fmt: skip
    assert result.best == {"batch_size": TUNED}
    counts = cache.counts()
    assert (counts["hits"], counts["misses"], counts["stored"], counts["plain_calls"]) == (0,) * 4
    assert counts["store_bytes"] == 0


def test_a_trial_batch_loses_its_index_without_handing_it_to_the_cache() -> None:
    """The tuner's trial batch passes the precision's ``convert_input`` as a training
    batch does: the index comes out, but is not the next training step's."""

    class Plugin:
        def convert_input(self, batch: Any) -> Any:
            return batch

    plugin, taker = Plugin(), IndexTaker()
    taker.attach(plugin)
    with side_run():
        batch = plugin.convert_input({"x": torch.zeros(2), INDEX_FIELD: SampleIndex([7, 3])})
    assert set(batch) == {"x"}
    assert taker.take() is None
    plugin.convert_input({"x": torch.zeros(2), INDEX_FIELD: SampleIndex([5, 1])})
    taken = taker.take()
    assert taken is not None
    assert taken.indices == [5, 1]
