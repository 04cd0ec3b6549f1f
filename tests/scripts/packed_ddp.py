"""Train a decoder on packed batches under DDP on two CPU processes (gloo), AttentionSwap on.

The decoder's blocks hold both paths that keep documents apart: an attention the kit
swaps (nanoGPT's) and one that calls SDPA itself with rotary positions. Each rank writes
the per-token losses of each of its steps. Run by tests/attention/test_packed_ddp.py
through tests/helpers/multiprocess.py, which replays the same steps in one process,
document by document.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap
from lightning_speedkit.attention._documents import active
from lightning_speedkit.data import PackingCollate
from tests.attention.test_packed_compiled import Decoder, _token_losses
from tests.attention.test_packed_ddp import BATCH_SIZE, LR, MAX_TOKENS, STEPS, samples
from tests.helpers.multiprocess import finish_rank


class Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Decoder()
        self.losses: list[list[float]] = []
        self.packed: list[bool] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        self.packed.append(active() is not None)
        losses = _token_losses(self.model, batch)
        self.losses.append(losses.detach().tolist())
        return losses.mean()

    def train_dataloader(self) -> DataLoader[Any]:
        """Rank r trains on documents r, r + 2, ... in order (no sampler to guess)."""
        mine = samples()[self.global_rank :: 2]
        return DataLoader(mine, batch_size=BATCH_SIZE, collate_fn=PackingCollate(MAX_TOKENS))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)  # two processes on two cores: no OpenMP oversubscription
    task = Task()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=STEPS,
        use_distributed_sampler=False,
        callbacks=[AttentionSwap(backend="sdpa", verbose=False)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(task)
    finish_rank(args.out, trainer.global_rank, {"losses": task.losses, "packed": task.packed})


if __name__ == "__main__":
    main()
