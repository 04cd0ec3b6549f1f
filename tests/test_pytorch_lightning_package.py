"""The kit under ``pytorch_lightning``, Lightning's older package name (another copy of its
code, installed beside ``lightning``): the callbacks work there, the strategies are refused
with the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import ActivationCheckpointing, AttentionSwap, SpeedkitConfigError

pl = pytest.importorskip("pytorch_lightning")


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, dim), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x, x, x, need_weights=False)[0]
        return x + self.ff(x)


class Task(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(Block(), Block())

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.blocks(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(torch.randn(8, 4, 16)), batch_size=4)


def fit(callback: Any) -> Task:
    model = Task()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, callbacks=[callback], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    return model


def test_checkpointing_reaches_a_pytorch_lightning_module() -> None:
    """That package's default ``configure_model`` is another function than ``lightning``'s:
    the kit read it as the module's own hook and waited for it, and its Trainer, seeing
    the default, never called it: nothing was checkpointed, silently."""
    callback = ActivationCheckpointing(verbose=False)
    fit(callback)
    assert callback.checkpointed == ["blocks.0", "blocks.1"]


def test_the_attention_swap_reaches_a_pytorch_lightning_module() -> None:
    callback = AttentionSwap(verbose=False)
    fit(callback)
    assert callback.report is not None
    assert len(callback.report.swapped) == 2


@pytest.mark.parametrize("name", ["ddp_powersgd", "fsdp_zero2", "deepspeed_zero2"])
def test_a_kit_strategy_name_is_refused_with_the_fix(name: str) -> None:
    refused = r"built on `lightning.pytorch`.*import lightning"
    with pytest.raises(SpeedkitConfigError, match=refused):
        pl.Trainer(accelerator="cpu", devices=1, strategy=name, logger=False)
