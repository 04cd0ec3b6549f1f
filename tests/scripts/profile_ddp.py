"""Two CPU ranks (gloo) profile a communication-bound job with ProfilerSchedule.

A 16 MiB table read through a sum (like an embedding that a step barely touches:
its gradient costs one broadcast) beside a small linear layer: the step's arithmetic
is almost nothing, and the all-reduce of 16 MiB of fp32 gradients over loopback is
about half of it on every rank (0.44-0.58 measured, also beside a busy core), well
clear of the report's 0.30 threshold. Four 1024x1024 linear layers, used before,
measured 0.29-0.50: their weight gradients and optimizer step grow with the same
bytes as the all-reduce, so on two shared cores the share sat on the threshold.
Each rank writes its report's kinds and breakdown.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import ProfilerSchedule

TABLE_ROWS, TABLE_COLS = 4096, 1024  # 16 MiB of fp32


class Wide(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(64, 64)
        self.table = nn.Parameter(torch.zeros(TABLE_ROWS, TABLE_COLS))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean() + self.table.sum() * 1e-6

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    profiler = ProfilerSchedule(skip_first=2, wait=0, warmup=1, active=3, repeat=1,
                                dirpath=args.out / "profiler", with_stack=False)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=7, logger=False,
        callbacks=[profiler], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    data = TensorDataset(torch.randn(64, 64))
    trainer.fit(Wide(), DataLoader(data, batch_size=1))
    report = profiler.report
    result = {
        "kinds": report.kinds if report is not None else None,
        "breakdown": report.breakdown if report is not None else None,
        "files": [str(p) for p in profiler.report_files],
    }
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
