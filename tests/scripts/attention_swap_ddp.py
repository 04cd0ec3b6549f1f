"""Train the example VLM with AttentionSwap under DDP on `--devices` CPU processes.

Each rank writes its swap report and the trained parameters' checksum. Run by
tests/attention/test_attention_swap.py through tests/helpers/multiprocess.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch

from lightning_speedkit import AttentionSwap
from speedkit_examples.vlm import CaptionTokenizer, CorpusConfig, VLMConfig, VLMDataModule, VLMTask
from tests.helpers.multiprocess import finish_rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--swap", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # two processes on two cores: no OpenMP oversubscription

    L.seed_everything(0, verbose=False)
    tokenizer = CaptionTokenizer()
    task = VLMTask(VLMConfig.preset("tiny", tokenizer.vocab_size), pad_id=tokenizer.pad_id)
    corpus = CorpusConfig(train_samples=96, val_samples=32, samples_per_shard=32)
    datamodule = VLMDataModule(args.data_dir, batch_size=4, corpus=corpus, progress=False)
    swap = AttentionSwap("sdpa", verbose=False)
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
        "params": [p.detach().double().sum().item() for p in task.parameters()],
    }
    finish_rank(args.out, trainer.global_rank, result)


if __name__ == "__main__":
    main()
