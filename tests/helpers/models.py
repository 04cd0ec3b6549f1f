"""Small LightningModules and datasets whose costs are known, for measuring the measurers."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


def _sleep(seconds: float) -> None:
    """The modules' and datasets' delays; a test on a virtual clock replaces it."""
    time.sleep(seconds)


class SlowDataset(Dataset[torch.Tensor]):
    """Random vectors; each item takes ``delay`` seconds to "load"."""

    def __init__(self, n: int = 64, dim: int = 32, delay: float = 0.0) -> None:
        self.data = torch.randn(n, dim, generator=torch.Generator().manual_seed(0))
        self.delay = delay

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay:
            _sleep(self.delay)
        return self.data[i]


class MLP(L.LightningModule):
    """Two linear layers; each training step also sleeps ``step_delay`` seconds."""

    def __init__(self, dim: int = 32, hidden: int = 64, step_delay: float = 0.0) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(dim, hidden, bias=False), torch.nn.ReLU(),
            torch.nn.Linear(hidden, dim, bias=False),
        )  # fmt: skip
        self.step_delay = step_delay

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.step_delay:
            _sleep(self.step_delay)
        return (self.net(batch) - batch).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def flops_per_sample(self) -> int:
        """Training FLOPs per sample: the input needs no gradient, so the first layer has no dX."""
        first, second = self.net[0].weight.numel(), self.net[2].weight.numel()
        return 4 * first + 6 * second


def loader(n: int = 64, dim: int = 32, batch_size: int = 8, delay: float = 0.0) -> DataLoader[Any]:
    return DataLoader(SlowDataset(n, dim, delay), batch_size=batch_size)
