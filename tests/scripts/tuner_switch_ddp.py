"""Two CPU ranks, one epoch: NumWorkersTuner's verdict (on set figures and a step clock)
switches every rank's loader mid-epoch; each rank records the samples it trained on and
the workers of the loader in use at each step."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_speedkit import NumWorkersTuner
from lightning_speedkit.data import num_workers_tuner, worker_search
from tests.data.conftest import Figures, StepClock
from tests.helpers.multiprocess import finish_rank
from tests.scripts.tuner_ddp import Indexed, Recorder, collate


class Steps(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.workers: list[int] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.workers.append(self.trainer.train_dataloader.num_workers)  # type: ignore[union-attr]
        return super().training_step(batch, batch_idx)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    # Each rank has "2 cores" that torch's 2 threads hold: no worker at setup; the model
    # consumes 731 batches/s against the loader's 10.3, so workers on both cores are tried.
    torch.set_num_threads(2)
    num_workers_tuner.cpu_budget = lambda local_world_size=1: 2  # type: ignore[assignment]
    worker_search._measure = Figures({0: 10.3, 1: 9.0, 2: 24.0, (2, 4): 23.0})  # type: ignore[assignment]
    worker_search._clock = StepClock(0.0)
    num_workers_tuner._clock = StepClock(1 / 731)
    tuner = NumWorkersTuner(batches=3, cache=False, progress=False, verdict_steps=4)
    model = Steps()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
        callbacks=[tuner], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(Indexed(96), batch_size=4, shuffle=True, collate_fn=collate))
    loader: Any = trainer.train_dataloader
    result = {
        "sampler": type(loader.sampler).__name__,
        "workers": model.workers,
        "best": tuner.result.best if tuner.result else None,
        "indices": model.seen,
    }
    finish_rank(args.out, trainer.global_rank, result)


if __name__ == "__main__":
    main()
