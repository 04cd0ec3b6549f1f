"""A small model with repeated blocks, its data, and recorders, for the compute-lever tests."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

DIM = 16


class Block(nn.Module):
    """A residual MLP block: the unit RegionalCompile and ActivationCheckpointing find."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(L.LightningModule):
    """Blocks over ``(batch, tokens, DIM)`` inputs; regression to a target per sample."""

    def __init__(self, depth: int = 2, optimizer: str = "adamw", lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(DIM, DIM)  # every block's input then needs grad, as in a real model
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(DIM, 1)
        self.optimizer = optimizer
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean(dim=(1, 2))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss, batch_size=x.shape[0])
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def dataset(n: int = 64, tokens: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, tokens, DIM, generator=g), torch.randn(n, generator=g))


def loader(n: int = 64, batch_size: int = 8, **kwargs: Any) -> DataLoader[Any]:
    return DataLoader(dataset(n), batch_size=batch_size, **kwargs)


class Losses(L.Callback):
    """Every training batch's loss, and the batches themselves."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list[Any] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"].detach()))
        self.batches.append(batch)


def trainer(steps: int, callbacks: list[L.Callback], **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, callbacks=callbacks,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0,
    )  # fmt: skip
    options.update(kwargs)
    return L.Trainer(**options)
