"""Two CPU ranks train a model with a frozen tower, with and without FrozenFeatureCache.

``--strategy NAME`` (``ddp``, ``deepspeed_zero2``, ``fsdp_zero2``, ``fsdp2_zero2``) and
``--runs A,B`` run in turn in the same two processes: ``plain`` (no cache), ``cached`` (the
cache, with the shared ``--features`` folder). Each fit is ``--epochs`` epochs of 64 samples
shuffled by Lightning's DistributedSampler: 4 steps of 8 per rank. A second invocation with
``--runs cached`` on the same folder is a new pair of processes starting warm.
``--retrain``: the optimizer holds every parameter, and the tower is unfrozen for epoch 1
only (trained then), frozen again from epoch 2.

Each rank writes, per run, its losses (as ``float.hex``: compared bit for bit), the rows
the tower ran on per call, and the cache's counts at each epoch's end.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_speedkit  # noqa: F401  (registers the ZeRO-2 presets)
from lightning_speedkit import FrozenFeatureCache
from tests.helpers.multiprocess import finish_rank

DIM, WIDE, SAMPLES, BATCH = 8, 16, 64, 8


class Pairs(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, DIM, generator=g)
        self.y = torch.sin(self.x[:, :1])

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "y": self.y[index]}


class Tower(nn.Module):
    """A frozen encoder: a row's output is the same bits in any batch (elementwise ops and a
    per-row norm), so served features compare bit for bit with the plain run's."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(WIDE))
        self.norm = nn.LayerNorm(WIDE)
        self.rows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(int(x.shape[0]))
        return torch.relu(self.norm(x.repeat(1, WIDE // DIM) * self.scale))


class Task(L.LightningModule):
    def __init__(self, retrain: bool = False) -> None:
        super().__init__()
        self.retrain = retrain
        torch.manual_seed(0)
        self.tower = Tower().requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(WIDE, WIDE), nn.GELU(), nn.Linear(WIDE, 1))
        self.losses: list[str] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.head(self.tower(batch["x"])), batch["y"])
        self.losses.append(float(loss.detach()).hex())
        return loss

    def on_train_epoch_start(self) -> None:
        if self.retrain:  # trained in epoch 1 alone
            self.tower.requires_grad_(self.current_epoch == 1)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD((self if self.retrain else self.head).parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Pairs(), batch_size=BATCH, shuffle=True)


class EpochCounts(L.Callback):
    """The cache's counts at each epoch's end (after it wrote and looked for shards), and
    the samples this rank trained on in the epoch."""

    def __init__(self, cache: FrozenFeatureCache) -> None:
        self.cache = cache
        self.counts: list[dict[str, int]] = []
        self.samples: list[list[int]] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        counts = self.cache.counts
        keys = ("hits", "misses", "stored", "plain_calls", "store_bytes", "disk_bytes",
                "disk_other_bytes")  # fmt: skip
        self.counts.append({k: counts[k] for k in keys})
        sampler = trainer.train_dataloader.sampler  # type: ignore[union-attr]
        self.samples.append(sorted(int(i) for i in sampler))


def fit(args: argparse.Namespace, cached: bool) -> tuple[int, dict[str, Any]]:
    L.seed_everything(0, verbose=False)
    callbacks: list[L.Callback] = []
    cache = None
    if cached:
        cache = FrozenFeatureCache(modules=["tower"], directory=args.features, budget=args.budget)
        callbacks = [cache, EpochCounts(cache)]  # the cache's epoch end first
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=args.strategy, max_epochs=args.epochs,
        logger=False, callbacks=callbacks, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    task = Task(args.retrain)
    trainer.fit(task)
    result = {"losses": task.losses, "tower_rows": task.tower.rows}
    if cache is not None:
        result["counts"] = callbacks[1].counts  # type: ignore[attr-defined]
        result["samples"] = callbacks[1].samples  # type: ignore[attr-defined]
    return trainer.global_rank, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--features", type=Path, required=True)
    parser.add_argument("--runs", default="plain,cached")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--budget", type=int, default=2**30, help="the cache's, in bytes")
    parser.add_argument("--retrain", action="store_true", help="the tower trains in epoch 1")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    rank = 0
    for run in args.runs.split(","):
        rank, results[run] = fit(args, cached=run == "cached")
    finish_rank(args.out, rank, results)


if __name__ == "__main__":
    main()
