"""Validate the example VLM on `--devices` CPU processes; each rank writes its metrics.

Run by tests/examples/vlm/test_task.py through tests/helpers/multiprocess.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch

from speedkit_examples.vlm import CaptionTokenizer, CorpusConfig, VLMConfig, VLMDataModule, VLMTask
from tests.helpers.multiprocess import finish_rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)  # two processes on two cores: no OpenMP oversubscription

    L.seed_everything(0, verbose=False)
    tokenizer = CaptionTokenizer()
    task = VLMTask(VLMConfig.preset("tiny", tokenizer.vocab_size), pad_id=tokenizer.pad_id)
    corpus = CorpusConfig(train_samples=96, val_samples=32, samples_per_shard=32)
    datamodule = VLMDataModule(args.data_dir, batch_size=4, corpus=corpus, progress=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (metrics,) = trainer.validate(task, datamodule=datamodule, verbose=False)
    result = {
        "world_size": trainer.world_size,
        "samples_seen": len(trainer.val_dataloaders.sampler),  # type: ignore[union-attr, arg-type]
        **{k: float(v) for k, v in metrics.items()},
    }
    finish_rank(args.out, trainer.global_rank, result)


if __name__ == "__main__":
    main()
