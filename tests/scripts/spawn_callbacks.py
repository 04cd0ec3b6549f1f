"""Two CPU ranks started by ``strategy="ddp_spawn"``, which pickles the Trainer and its
callbacks to hand them to the ranks: HangWatchdog, ProfilerSchedule, AccumulationScheduler
and SpeedMonitor. Each rank writes what its callbacks did to ``rank{N}.json``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import AccumulationScheduler, HangWatchdog, ProfilerSchedule, SpeedMonitor


class Regression(L.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.out, self.watched = out, []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        watchdog = next(c for c in self.trainer.callbacks if isinstance(c, HangWatchdog))
        self.watched.append(watchdog.running)
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_end(self) -> None:
        callbacks = {type(c).__name__: c for c in self.trainer.callbacks}
        rank = self.trainer.global_rank
        result = {
            "global_step": self.trainer.global_step,
            "watched": self.watched,
            "global_batches": [c.global_batch for c in callbacks["AccumulationScheduler"].history],
            "traced": (self.out / "profiler" / f"rank{rank}-window0.pt.trace.json.gz").exists(),
            "samples_per_sec": callbacks["SpeedMonitor"].summary["samples_per_sec"],
        }
        (self.out / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    callbacks = [
        HangWatchdog(),
        ProfilerSchedule(
            skip_first=0, wait=0, warmup=0, active=1, repeat=1, dirpath=out / "profiler"
        ),
        AccumulationScheduler(target_global_batch=32),
        SpeedMonitor(),
    ]
    trainer = L.Trainer(
        strategy="ddp_spawn", devices=2, accelerator="cpu", max_steps=2, callbacks=callbacks,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out,
    )  # fmt: skip
    trainer.fit(Regression(out), DataLoader(TensorDataset(torch.randn(128, 4)), batch_size=8))


if __name__ == "__main__":
    main()
