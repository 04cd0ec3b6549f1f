"""Two CPU ranks fit with a DeepSpeed ZeRO-2 preset (``--strategy NAME``), then validate,
test and predict from its checkpoint, each with a new Trainer, as LightningCLI's
``validate``, ``test`` and ``predict`` do.

Each rank writes the losses each stage logged, the loss its fitted module gives in
plain torch, an untrained module's, and its predictions beside the fitted module's.
Run by tests/distributed/test_deepspeed_evaluate.py through tests/helpers/multiprocess.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_speedkit  # noqa: F401  (registers the strategies)
from tests.helpers.multiprocess import finish_rank

DIM = 16


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, DIM, generator=g)
    return TensorDataset(x, x[:, :1] * 2 - x[:, 1:2])


class Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(DIM, 32), nn.GELU(), nn.Linear(32, 1))

    def _loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def _loader(self) -> DataLoader[Any]:
        data, trainer = dataset(), self.trainer
        sampler = DistributedSampler(data, trainer.world_size, trainer.global_rank, shuffle=False)
        return DataLoader(data, batch_size=16, sampler=sampler)

    train_dataloader = val_dataloader = test_dataloader = predict_dataloader = _loader


def full_loss(task: Task) -> float:
    x, y = dataset().tensors
    with torch.no_grad():
        return float(nn.functional.mse_loss(task.net(x), y))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    def trainer(**kwargs: Any) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=2, strategy=args.strategy, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, **kwargs)  # fmt: skip

    fitted = Task()
    # An epoch is one step (16 samples a rank): the checkpoint is the last step's.
    ckpt = ModelCheckpoint(args.out / "ckpt")
    trainer(max_steps=6, callbacks=[ckpt], limit_val_batches=0).fit(fitted)
    path = str(args.out / "ckpt" / "epoch=5-step=6.ckpt")
    x = dataset().tensors[0]
    result: dict[str, Any] = {"fitted_loss": full_loss(fitted), "untrained_loss": full_loss(Task())}
    with torch.no_grad():
        result["fitted_predictions"] = fitted.net(x).flatten().tolist()
    (val,) = trainer().validate(Task(), ckpt_path=path, verbose=False)
    (test,) = trainer().test(Task(), ckpt_path=path, verbose=False)
    predicted = trainer().predict(Task(), ckpt_path=path)
    assert predicted is not None
    rank = torch.distributed.get_rank()
    result |= {
        "val_loss": float(val["val_loss"]),
        "test_loss": float(test["test_loss"]),
        "predictions": torch.cat(predicted).flatten().tolist(),
        "rank": rank,
    }
    finish_rank(args.out, rank, result)


if __name__ == "__main__":
    main()
