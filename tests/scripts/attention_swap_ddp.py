"""Train the example VLM with AttentionSwap under DDP on two CPU processes.

Each rank writes its swap report, the modules that run swapped, and the trained
parameters' checksum. Run by tests/attention/test_attention_swap.py through
tests/helpers/multiprocess.py.

``--disagree`` makes rank 1 decide differently from rank 0, as ranks can on their own
batches: its ``auto`` has only ``math`` to pick (rank 0: ``sdpa`` or ``flash``) and
its parity check fails one module (``--revert-on-rank-1``). Both ranks time on a
virtual clock, each backend twice as fast as the module's own forward: tiny blocks on
CPU time by noise, and ``auto`` keeps a module's own forward where that was faster.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_speedkit import AttentionSwap
from lightning_speedkit.attention import _swapped_forward as _swap_module
from lightning_speedkit.attention.swap import swapped_modules
from speedkit_examples.vlm import CaptionTokenizer, CorpusConfig, VLMConfig, VLMDataModule, VLMTask
from tests.attention.test_auto_keeps_own import rig_auto_timing
from tests.helpers.multiprocess import finish_rank


class DisagreeingSwap(AttentionSwap):
    """AttentionSwap whose ranks would decide differently (see the module docstring)."""

    def __init__(self, revert: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.revert = revert

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        rig_auto_timing(pytest.MonkeyPatch(), own=2.0, fused=1.0)  # this process's, never undone
        if trainer.global_rank == 1:
            _swap_module.auto_candidates = lambda device: ("math",)
            swapped_modules(pl_module)[self.revert].tolerance = -1.0  # no error passes: fails here
        else:
            _swap_module.auto_candidates = lambda device: ("sdpa", "flash")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--swap", action="store_true")
    parser.add_argument("--backend", default="sdpa")
    parser.add_argument("--revert-on-rank-1", default=None, help="with --disagree: this module")
    parser.add_argument("--disagree", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # two processes on two cores: no OpenMP oversubscription

    L.seed_everything(0, verbose=False)
    tokenizer = CaptionTokenizer()
    task = VLMTask(VLMConfig.preset("tiny", tokenizer.vocab_size), pad_id=tokenizer.pad_id)
    corpus = CorpusConfig(train_samples=96, val_samples=32, samples_per_shard=32)
    datamodule = VLMDataModule(args.data_dir, batch_size=4, corpus=corpus, progress=False)
    if args.disagree:
        swap: AttentionSwap = DisagreeingSwap(args.revert_on_rank_1, backend=args.backend)
    else:
        swap = AttentionSwap(args.backend, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=6,
        limit_val_batches=0,
        callbacks=[swap] if args.swap else [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(task, datamodule=datamodule)
    report = swap.report.as_dict() if args.swap and swap.report else {}
    result = {
        "report": report,
        "running": sorted(swapped_modules(task)),
        "params": [p.detach().double().sum().item() for p in task.parameters()],
    }
    finish_rank(args.out, trainer.global_rank, result)


if __name__ == "__main__":
    main()
