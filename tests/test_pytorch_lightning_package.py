"""The kit under ``pytorch_lightning``, Lightning's older package name (another copy of its
code, installed beside ``lightning``): the callbacks work there, the strategies are refused
with the fix."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from lightning_utilities.core import rank_zero as rank_zero_module
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_speedkit
from lightning_speedkit import ActivationCheckpointing, AttentionSwap, SpeedkitConfigError


@pytest.fixture(scope="module")
def pl() -> Any:
    """``pytorch_lightning``, imported when these tests run (not when pytest collects this
    file): importing it rebinds the log of Lightning's rank-zero messages to its own
    logger, put back here for the tests that run after these in this process."""
    lightnings_log = rank_zero_module.log
    package = pytest.importorskip("pytorch_lightning")
    rank_zero_module.log = lightnings_log
    lightning_speedkit._register_strategies()  # as an import after pytorch_lightning's does
    return package


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, dim), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x, x, x, need_weights=False)[0]
        return x + self.ff(x)


def fit(pl: Any, callback: Any) -> Any:
    class Task(pl.LightningModule):  # type: ignore[misc,name-defined]
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

    model = Task()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, callbacks=[callback], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    return model


def test_checkpointing_reaches_a_pytorch_lightning_module(pl: Any) -> None:
    """That package's default ``configure_model`` is another function than ``lightning``'s:
    the kit read it as the module's own hook and waited for it, and its Trainer, seeing
    the default, never called it: nothing was checkpointed, silently."""
    callback = ActivationCheckpointing(verbose=False)
    fit(pl, callback)
    assert callback.checkpointed == ["blocks.0", "blocks.1"]


def test_the_attention_swap_reaches_a_pytorch_lightning_module(pl: Any) -> None:
    callback = AttentionSwap(verbose=False)
    fit(pl, callback)
    assert callback.report is not None
    assert len(callback.report.swapped) == 2


def test_the_kit_does_not_import_pytorch_lightning_itself() -> None:
    """Importing it moves Lightning's own log messages to its logger (their module's
    ``log`` is rebound), out of reach of a ``lightning.pytorch`` user's settings."""
    code = "import sys, lightning_speedkit; print('pytorch_lightning' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", ["ddp_powersgd", "fsdp_zero2", "deepspeed_zero2"])
def test_a_kit_strategy_name_is_refused_with_the_fix(pl: Any, name: str) -> None:
    refused = r"built on `lightning.pytorch`.*import lightning"
    with pytest.raises(SpeedkitConfigError, match=refused):
        pl.Trainer(accelerator="cpu", devices=1, strategy=name, logger=False)
