"""Train a tiny Hugging Face Llama with AttentionSwap on two CPU processes (``--strategy``).

Under ``fsdp2_zero2`` the swapped module is the whole Llama (family ``huggingface``), which
holds the FSDP2 units (its decoder layers) while its embedding and head belong to the root
unit: the swap's parity check must leave the root's parameters gathered for the rest of the
step. Each rank writes its losses and its swap report. Run by
tests/attention/test_swap_under_fsdp2.py through tests/helpers/multiprocess.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import AttentionSwap  # registers the strategies
from lightning_speedkit.attention.swap import swapped_modules
from tests.helpers.hf_tiny import tiny_model
from tests.helpers.multiprocess import finish_rank

VOCAB, TOKENS, SAMPLES, MICRO = 64, 16, 32, 4

LLAMA = tiny_model("LlamaConfig", "LlamaForCausalLM", vocab_size=VOCAB, hidden_size=32,
                   intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64,
                   tie_word_embeddings=True, attn_implementation="eager")  # fmt: skip


class Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = LLAMA()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())  # SYNC: a test's record, on CPU
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", default="fsdp2_zero2")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # two processes on two cores: no OpenMP oversubscription

    torch.manual_seed(0)
    task = Task()
    ids = torch.randint(3, VOCAB, (SAMPLES, TOKENS), generator=torch.Generator().manual_seed(0))
    swap = AttentionSwap("sdpa", verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.strategy,
        max_steps=args.steps,
        callbacks=[swap],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(task, DataLoader(TensorDataset(ids), batch_size=MICRO))
    assert swap.report is not None
    result = {
        "losses": task.losses,
        "report": swap.report.as_dict(),
        "running": sorted(swapped_modules(task)),
    }
    finish_rank(args.out, trainer.global_rank, result)


if __name__ == "__main__":
    main()
