"""Packed batches in every loop a Trainer runs: fit, validate, test and predict.

A user who trains on packed batches evaluates and predicts on them too; each loop's batch
reaches the swapped attention as documents, so each step's per-token losses are those of
the documents run one by one.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap
from lightning_speedkit.attention._documents import active
from lightning_speedkit.data import PackingCollate

from .test_packed_documents import MAX_TOKENS, NanoGPT, _one_by_one, _samples, _token_losses


class _Task(L.LightningModule):
    """Records, for each loop, whether documents were active and the per-token losses."""

    def __init__(self) -> None:
        super().__init__()
        self.model = NanoGPT()
        self.seen: dict[str, list[bool]] = {}
        self.losses: dict[str, list[Tensor]] = {}

    def _record(self, stage: str, batch: dict[str, Any]) -> Tensor:
        self.seen.setdefault(stage, []).append(active() is not None)
        losses = _token_losses(self.model, batch)
        self.losses.setdefault(stage, []).append(losses.detach().clone())
        return losses.sum()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        return self._record("train", batch)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._record("validate", batch)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._record("test", batch)

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        return self._record("predict", batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _trainer() -> L.Trainer:
    return L.Trainer(max_steps=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0,
                     callbacks=[AttentionSwap(backend="sdpa", verbose=False)])  # fmt: skip


@pytest.mark.parametrize("stage", ["test", "predict"])
def test_test_and_predict_batches_keep_documents_apart(stage: str) -> None:
    torch.manual_seed(0)
    task = _Task()
    loader = DataLoader(_samples(), batch_size=6, collate_fn=PackingCollate(MAX_TOKENS))
    trainer = _trainer()
    getattr(trainer, stage)(task, loader)
    assert task.seen[stage] == [True]
    assert active() is None  # cleared after the step
    alone = _one_by_one(task.model, _samples())
    assert (task.losses[stage][0] - alone).abs().max().item() <= 1e-5


def test_one_trainer_fits_tests_and_predicts_packed_alike() -> None:
    """fit (with its validation), then test and predict on the same Trainer."""
    torch.manual_seed(0)
    task = _Task()
    loader = DataLoader(_samples(), batch_size=6, collate_fn=PackingCollate(MAX_TOKENS))
    trainer = _trainer()
    trainer.fit(task, loader, loader)
    trainer.test(task, loader)
    trainer.predict(task, loader)
    alone = _one_by_one(task.model, _samples())  # lr 0: the weights never moved
    assert set(task.seen) == {"train", "validate", "test", "predict"}
    for stage, losses in task.losses.items():
        assert task.seen[stage] == [True], stage
        assert (losses[0] - alone).abs().max().item() <= 1e-5, stage
