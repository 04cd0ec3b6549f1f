"""A frozen teacher updated through ``p.data`` (an EMA, as DINO and MoCo write it).

Such a write bumps no version counter the cache's per-call check reads: the cache served
features of the teacher's old weights, silently (losses 0.06-0.10 off, with ``verify``
on, found by a new-user probe). The weights are fingerprinted again as each epoch starts.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import FrozenFeatureCache
from tests.helpers.one_thread import one_intra_op_thread  # noqa: F401 (autouse)


class Distilled(L.LightningModule):
    def __init__(self, write: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Linear(16, 32)
        self.teacher = nn.Linear(16, 32).requires_grad_(False)  # moved by the EMA only
        self.head = nn.Linear(64, 3)
        self.write = write
        self.losses: list[float] = []

    def on_train_epoch_start(self) -> None:
        if self.current_epoch < 2:  # after the cache's first reuse (epoch 1) was verified
            return
        pairs = zip(self.teacher.parameters(), self.student.parameters(), strict=True)
        for teacher, student in pairs:
            if self.write == "p.data.mul_":
                teacher.data.mul_(0.5).add_(0.5 * student.data)
            else:
                teacher.data = teacher.data * 0.5 + student.data * 0.5

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        features = torch.cat([self.student(x), self.teacher(x)], -1)
        loss = nn.functional.cross_entropy(self.head(features), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trained = [*self.student.parameters(), *self.head.parameters()]
        return torch.optim.SGD(trained, lr=0.1)


def _fit(write: str, *callbacks: L.Callback) -> list[float]:
    module = Distilled(write)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 16, generator=g), torch.randint(0, 3, (32,), generator=g))
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=4, callbacks=list(callbacks), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=8))
    return module.losses


@pytest.mark.parametrize("write", ["p.data.mul_", "p.data ="])
def test_an_ema_teacher_written_through_data_is_never_served_stale(write: str) -> None:
    cache = FrozenFeatureCache(modules="teacher")
    assert _fit(write, cache) == _fit(write)  # bit for bit, fp32 on CPU
    counts = cache.counts
    assert counts["hits"] == 32 - 8  # epoch 1 served, but the verified batch
    assert counts["misses"] == 32 + 8 + 2 * 32  # epoch 0, the check, epochs 2-3 (new weights)
