"""Does ddp_powersgd train the example VLM as well as plain DDP, and at which rank?

PowerSGD sends a rank-r approximation of each gradient matrix, with error feedback
adding back what it dropped. The paper trained with SGD and momentum; the example VLM
trains with AdamW at a high learning rate, which rescales every coordinate of the
(approximated) gradient. This benchmark trains the tiny VLM on two CPU processes with
plain DDP and with ``ddp_powersgd`` at several ranks, for a few seeds, and reports the
held-out loss and token accuracy after ``--steps`` steps, the compression ratio and
the run's samples/s.

    python benchmarks/powersgd_rank.py                          # ranks 1 2 4, seeds 0 1
    python benchmarks/powersgd_rank.py --ranks 1 4 --seeds 0 --steps 300

Every run trains in the same processes, one after the other (Lightning re-runs this
script in the second process, which follows the same sequence). Prints a table and
writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_speedkit.distributed import DDPPowerSGDStrategy
from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule, VLMTask

HERE = Path(__file__).resolve()


def _train(variant: str, rank: int | None, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    L.seed_everything(seed, workers=True, verbose=False)
    tokenizer = CaptionTokenizer()
    cfg = VLMConfig.preset(args.size, tokenizer.vocab_size)  # type: ignore[arg-type]
    datamodule = VLMDataModule.for_model(
        cfg, args.data_dir, batch_size=args.batch_size, progress=False
    )
    task = VLMTask(cfg, pad_id=tokenizer.pad_id)
    strategy: Any = "ddp" if rank is None else DDPPowerSGDStrategy(rank=rank)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        limit_val_batches=0,  # one held-out pass after training
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(task, datamodule=datamodule)
    seconds = time.perf_counter() - start
    compression = None
    state = getattr(trainer.strategy, "powersgd_state", None)
    if state is not None and state.total_numel_after_compression:
        compression = state.total_numel_before_compression / state.total_numel_after_compression
    trainer.limit_val_batches = 1.0
    (metrics,) = trainer.validate(task, datamodule=datamodule, verbose=False)
    return {
        "variant": variant,
        "rank": rank,
        "seed": seed,
        "held_out_loss": float(metrics["val/loss"]),
        "held_out_acc": float(metrics["val/acc"]),
        "compression_ratio": compression,
        "samples_per_sec": args.steps * args.batch_size * trainer.world_size / seconds,
        "seconds": seconds,
        "is_global_zero": trainer.is_global_zero,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", type=Path, default=HERE.parent / "results" / "powersgd_rank.json")
    args = parser.parse_args(argv)
    if any(r < 1 for r in args.ranks):
        parser.error(f"--ranks: each must be at least 1, got {args.ranks}")
    for flag in ("steps", "devices", "batch_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be at least 1")

    variants: list[tuple[str, int | None]] = [("ddp", None)]
    variants += [(f"ddp_powersgd rank {r}", r) for r in args.ranks]
    rows = [_train(name, rank, seed, args) for seed in args.seeds for name, rank in variants]
    if not rows[0]["is_global_zero"]:
        return 0  # the other processes: rank 0 reports

    print(
        f"\nVLM {args.size}, {args.devices} CPU processes, batch {args.batch_size} per "
        f"process, {args.steps} steps, seeds {args.seeds}; held-out loss (token accuracy)"
    )
    seeds_header = "".join(f"{'seed ' + str(s):>18}" for s in args.seeds)
    print(f"{'':<24}{seeds_header}{'mean loss':>11}{'compression':>13}{'samples/s':>11}")
    for name, _ in variants:
        mine = [r for r in rows if r["variant"] == name]
        cells = "".join(
            f"{r['held_out_loss']:>10.3f} ({r['held_out_acc']:.1%})".rjust(18) for r in mine
        )
        ratio = mine[0]["compression_ratio"]
        print(
            f"{name:<24}{cells}{statistics.fmean(r['held_out_loss'] for r in mine):>11.3f}"
            f"{(f'{ratio:.1f}x' if ratio else '-'):>13}"
            f"{statistics.fmean(r['samples_per_sec'] for r in mine):>11.1f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "size": args.size,
                "devices": args.devices,
                "batch_size": args.batch_size,
                "steps": args.steps,
                "rows": [{k: v for k, v in r.items() if k != "is_global_zero"} for r in rows],
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
