"""Two CPU ranks fit a model with no repeated blocks under ``fsdp_zero2`` (one FSDP unit,
the whole model), then validate and test with the Trainer that fitted it, as a script
does after ``fit``; and validate from the checkpoint with a new Trainer.

Each rank writes the three losses. Run by tests/distributed/test_fsdp_evaluate_after_fit.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_speedkit  # noqa: F401  (registers the strategies)
from tests.helpers.multiprocess import finish_rank
from tests.scripts.deepspeed_evaluate import Task


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    def trainer(**kwargs: Any) -> L.Trainer:
        return L.Trainer(accelerator="cpu", devices=2, strategy="fsdp_zero2", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, **kwargs)  # fmt: skip

    fitted, ckpt = Task(), ModelCheckpoint(args.out / "ckpt")
    fitting = trainer(max_steps=4, callbacks=[ckpt])
    fitting.fit(fitted)
    (after,) = fitting.validate(fitted, verbose=False)
    (tested,) = fitting.test(fitted, verbose=False)
    path = str(args.out / "ckpt" / "epoch=3-step=4.ckpt")
    (loaded,) = trainer().validate(Task(), ckpt_path=path, verbose=False)
    rank = torch.distributed.get_rank()
    result = {
        "val_after_fit": float(after["val_loss"]),
        "test_after_fit": float(tested["test_loss"]),
        "val_from_checkpoint": float(loaded["val_loss"]),
        "blocks": [kind.__name__ for kind in fitting.strategy.blocks],  # type: ignore[attr-defined]
        "rank": rank,
    }
    finish_rank(args.out, rank, result)


if __name__ == "__main__":
    main()
