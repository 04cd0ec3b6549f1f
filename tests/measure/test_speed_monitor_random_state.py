"""SpeedMonitor only measures: a seeded run sees the same batches with it as without.

On a CPU, SpeedMonitor's default ``peak_flops="auto"`` times a matmul before the first
epoch. Its operands came from torch's global generator, from which the loader draws its
shuffle seed as each epoch starts: the run saw other batches, and every loss changed.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import SpeedMonitor
from lightning_speedkit.measure.peak import measure_matmul_peak


def test_timing_the_matmul_peak_draws_nothing_from_the_global_generator() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert measure_matmul_peak("cpu", size=64, seconds=0.01) > 0
    assert torch.equal(torch.get_rng_state(), before)


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.seen: list[list[int]] = []
        self.losses: list[Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, index = batch
        self.seen.append(index.tolist())
        loss = nn.functional.mse_loss(self.layer(x).squeeze(-1), y)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(callbacks: list[L.Callback]) -> Regression:
    L.seed_everything(0, verbose=False)
    model = Regression()
    data = TensorDataset(torch.randn(32, 4), torch.randn(32), torch.arange(32))
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True))
    return model


def test_a_seeded_fit_sees_the_same_batches_and_losses_with_speed_monitor() -> None:
    plain = _fit([])
    monitored = _fit([SpeedMonitor()])  # peak_flops="auto": measured on this CPU
    assert monitored.seen == plain.seen
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, monitored.losses, strict=True))
