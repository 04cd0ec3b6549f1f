"""Two CPU ranks train a small MLP under SpeedMonitor, rank 1 the slower; each rank writes
its summary."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import ClassVar

import lightning as L
import torch

from lightning_speedkit import SpeedMonitor
from tests.helpers.models import MLP, loader
from tests.helpers.multiprocess import finish_rank


class SeenLogger(L.pytorch.loggers.CSVLogger):
    seen: ClassVar[set[str]] = set()

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        SeenLogger.seen |= set(metrics)
        super().log_metrics(metrics, step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    monitor = SpeedMonitor(peak_flops=None, log_every_n_steps=5)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=20,
        logger=SeenLogger(args.out / "logs"), callbacks=[monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    # rank 1 computes 0.1 s more a step before backward: a straggler the all-reduce hides
    trainer.fit(MLP(step_delay=0.02 + 0.1 * trainer.global_rank), loader(n=400, batch_size=8))
    result = {"summary": monitor.summary, "logged_keys": sorted(SeenLogger.seen)}
    finish_rank(args.out, trainer.global_rank, result)


if __name__ == "__main__":
    main()
