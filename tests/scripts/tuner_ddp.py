"""Two CPU ranks fit with NumWorkersTuner; each rank records which samples it trained on.

--mode plain: a loader passed to fit (Lightning injects its DistributedSampler).
--mode bucketed: a SpeedDataModuleMixin DataModule with length bucketing.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit import NumWorkersTuner, SpeedDataModuleMixin
from tests.helpers.multiprocess import finish_rank


class Indexed(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"idx": torch.tensor(i), "x": torch.full((3,), float(i))}


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([item[k] for item in items]) for k in items[0]}


class Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.seen: list[int] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.extend(batch["idx"].tolist())
        return self.layer(batch["x"]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Bucketed(SpeedDataModuleMixin, L.LightningDataModule):
    def train_dataloader(self) -> DataLoader[Any]:
        lengths = [(i * 7) % 13 + 1 for i in range(50)]
        return self.speed_dataloader(Indexed(50), batch_size=4, shuffle=True, lengths=lengths,
                                     collate_fn=collate)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=("plain", "bucketed"), default="plain")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tuner = NumWorkersTuner(max_workers=1, batches=3, cache=False, progress=False, verdict_steps=0)
    model = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
        callbacks=[tuner], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    if args.mode == "plain":
        trainer.fit(model, DataLoader(Indexed(64), batch_size=4, shuffle=True, collate_fn=collate))
    else:
        trainer.fit(model, datamodule=Bucketed())
    loader = trainer.train_dataloader
    result = {
        "sampler": type(loader.sampler).__name__,
        "num_workers": loader.num_workers,
        "tuned_num_workers": tuner.result.best["num_workers"] if tuner.result else None,
        f"{args.mode}_indices": model.seen,
    }
    finish_rank(args.out, trainer.global_rank, result)


if __name__ == "__main__":
    main()
