"""Two CPU ranks train under HangWatchdog; one rank sleeps inside one training step.

With ``--action dump`` each rank writes its watchdog's events and the wall-clock times of
the sleeping step; with ``--action abort`` the watchdog ends the job, and the test judges
the exit status and the files it left.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_speedkit import HangWatchdog
from tests.helpers.models import MLP, loader
from tests.helpers.multiprocess import finish_rank


def stuck_in_training_step(seconds: float) -> None:
    """The frame the sleeping rank's dump must name."""
    time.sleep(seconds)


def stuck_after_training_step(seconds: float) -> None:
    """The frame the rank sleeping in the batch's end must name."""
    time.sleep(seconds)


class SleepyMLP(MLP):
    """Every rank sleeps ``first_step`` s in its first step (a compile); ``hang_rank`` sleeps
    ``hang_seconds`` in batch ``hang_batch`` (1-based) while the others wait for it."""

    def __init__(self, first_step: float, hang_rank: int, hang_batch: int, hang_seconds: float,
                 after_step: bool = False):  # fmt: skip
        super().__init__()
        self.after_step = after_step
        self.first_step, self.hang_rank = first_step, hang_rank
        self.hang_batch, self.hang_seconds = hang_batch, hang_seconds
        self.batches = 0
        self.hang_window: tuple[float, float] | None = None

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.batches += 1
        if self.batches == 1 and self.first_step:
            time.sleep(self.first_step)
        if self.batches == self.hang_batch and not self.after_step:
            started = time.time()
            if self.global_rank == self.hang_rank:
                stuck_in_training_step(self.hang_seconds)
            self.hang_window = (started, time.time())
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """With ``after_step``, the sleep is in the batch's end, after its step."""
        if self.after_step and self.batches == self.hang_batch:
            started = time.time()
            if self.global_rank == self.hang_rank:
                stuck_after_training_step(self.hang_seconds)
            self.hang_window = (started, time.time())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--action", choices=("dump", "abort"), default="dump")
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--min-timeout", type=float, default=2.0)
    parser.add_argument("--first-step", type=float, default=0.0)
    parser.add_argument("--hang-batch", type=int, default=8)
    parser.add_argument("--hang-seconds", type=float, default=6.0)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--after-step", action="store_true", help="sleep in the batch's end")
    args = parser.parse_args()
    torch.set_num_threads(1)
    watchdog = HangWatchdog(
        timeout=args.timeout, min_timeout=args.min_timeout, dirpath=args.out / "dumps",
        action=args.action,
    )  # fmt: skip
    model = SleepyMLP(args.first_step, 1, args.hang_batch, args.hang_seconds, args.after_step)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=args.max_steps, logger=False,
        callbacks=[watchdog], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, loader(n=256, batch_size=8))
    result: dict[str, Any] = {
        "events": [dataclasses.asdict(event) for event in watchdog.events],
        "hang_window": model.hang_window,
        "batches": model.batches,
        "running_after_fit": watchdog.running,
    }
    finish_rank(args.out, trainer.global_rank, result)


if __name__ == "__main__":
    main()
