"""The example VLM's JPEG shards through the DataLoader: plain, tuned, a full grid, padding.

1. An exhaustive grid of worker settings (num_workers 0..budget x prefetch_factor
   1, 2, 4, 8 x persistent_workers), each measured carefully (``--grid-batches``
   batches after warm-up, in ``--grid-rounds`` interleaved rounds, best round
   kept): the ground truth.
2. ``tune_num_workers`` on the same loader, timed (no cache): its pick is looked up
   in the grid, and compared with the grid's best (goal: >= 0.95) and its tuning
   time with the grid's (goal: <= 20%). The grid's best is the luckiest of its
   settings' best rounds, so the pick and the grid's best are then timed again side by
   side (``--confirm-rounds`` interleaved rounds, medians): that ratio is the one the goal
   is read on.
3. Padding waste of an epoch of batches of 32 captions: random batches against
   ``LengthBucketBatchSampler``.

    python benchmarks/dataloader.py

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from lightning_speedkit.data import LengthBucketBatchSampler, tune_num_workers
from lightning_speedkit.data.worker_search import _measure, cpu_budget, rebuild_dataloader
from speedkit_examples.vlm import VLMConfig, VLMDataModule


def _padding_waste(batches: list[list[int]], lengths: list[int]) -> float:
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    real = sum(lengths[i] for b in batches for i in b)
    return 1 - real / padded


def _settings(pick: dict[str, Any]) -> dict[str, Any]:
    keys = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")
    return {k: pick[k] for k in keys if k in pick}


def _side_by_side(
    loader: Any, pick: dict[str, Any], best: dict[str, Any], rounds: int, batches: int
) -> dict[str, Any]:
    """The pick and the grid's best timed again in interleaved rounds: medians and ratio.

    Picking the largest of 17 noisy figures favours whichever setting had a lucky round;
    timing the two again, alternately, compares the settings rather than their luck.
    """
    if _settings(pick) == _settings(best):
        return {"same_setting": True, "pick": [], "best": [], "pick_over_best": 1.0}
    times: dict[str, list[float]] = {"pick": [], "best": []}
    for r in range(rounds):
        order = ("pick", "best") if r % 2 == 0 else ("best", "pick")
        for name in order:
            dl = rebuild_dataloader(loader, **_settings(pick if name == "pick" else best))
            times[name].append(_measure(dl, 3, batches, max_seconds=120, timeout=60))
    ratio = statistics.median(times["pick"]) / statistics.median(times["best"])
    return {"same_setting": False, **times, "pick_over_best": ratio}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="tiny", choices=("tiny", "small", "base"))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--grid-batches", type=int, default=80)
    parser.add_argument("--grid-rounds", type=int, default=2)
    parser.add_argument(
        "--confirm-rounds", type=int, default=7,
        help="interleaved rounds timing the pick and the grid's best side by side",
    )  # fmt: skip
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/dataloader.json"))
    args = parser.parse_args(argv)

    cfg = VLMConfig.preset(args.size, vocab_size=35)
    dm = VLMDataModule.for_model(cfg, args.data_dir, batch_size=args.batch_size, progress=False)
    dm.setup("fit")
    loader = dm.train_dataloader()
    budget = cpu_budget()

    grid: list[dict[str, Any]] = []
    grid_start = time.perf_counter()
    pin = torch.cuda.is_available()
    settings = [
        {
            "num_workers": 0,
            "pin_memory": False,
            "persistent_workers": False,
            "prefetch_factor": None,
        }
    ]
    for n, prefetch, persistent in itertools.product(
        range(1, budget + 1), (1, 2, 4, 8), (False, True)
    ):
        settings.append(
            {"num_workers": n, "pin_memory": pin, "persistent_workers": persistent,
             "prefetch_factor": prefetch}
        )  # fmt: skip
    rates: list[list[float]] = [[] for _ in settings]
    for _ in range(args.grid_rounds):  # rounds interleave, so drift hits every setting alike
        for i, s in enumerate(settings):
            dl = rebuild_dataloader(loader, **s)
            rates[i].append(_measure(dl, 3, args.grid_batches, max_seconds=120, timeout=60))
    for s, r in zip(settings, rates, strict=True):
        rate = max(r)  # the least disturbed round
        grid.append({**s, "batches_per_sec": rate, "samples_per_sec": rate * args.batch_size,
                     "rounds": r})  # fmt: skip
    grid_seconds = time.perf_counter() - grid_start

    tune_start = time.perf_counter()
    tuned = tune_num_workers(loader, cache=False, progress=False)
    tune_seconds = time.perf_counter() - tune_start

    def grid_rate(pick: dict[str, Any]) -> float:
        for row in grid:
            same = all(row[k] == pick[k] for k in ("num_workers", "prefetch_factor"))
            if same and (
                pick["num_workers"] == 0 or row["persistent_workers"] == pick["persistent_workers"]
            ):
                return float(row["batches_per_sec"])
        raise KeyError(pick)

    best = max(grid, key=lambda r: r["batches_per_sec"])
    plain = grid[0]["batches_per_sec"]
    pick_rate = grid_rate(tuned.best)
    confirmed = _side_by_side(
        loader, tuned.best, best, args.confirm_rounds, args.grid_batches
    )  # fmt: skip

    ds = dm.datasets["train"]
    lengths = ds.caption_lengths()
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).tolist()
    random_batches = [order[i : i + args.batch_size] for i in range(0, len(order), args.batch_size)]
    bucketed = list(LengthBucketBatchSampler(lengths, args.batch_size, num_replicas=1, rank=0))

    report = {
        "benchmark": "dataloader",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cores_for_this_process": budget,
            "cpu": platform.processor() or platform.machine(),
        },
        "torch": torch.__version__,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "grid": grid,
        "grid_seconds": grid_seconds,
        "plain_samples_per_sec": plain * args.batch_size,
        "grid_best": best,
        "tuner_pick": tuned.best,
        "tuner_pick_samples_per_sec": pick_rate * args.batch_size,
        "pick_over_grid_best": pick_rate / best["batches_per_sec"],
        "tuned_over_plain": pick_rate / plain,
        "confirmed": confirmed,
        "pick_over_grid_best_confirmed": confirmed["pick_over_best"],
        "tuning_seconds": tune_seconds,
        "tuning_over_grid_time": tune_seconds / grid_seconds,
        "padding_waste_random": _padding_waste(random_batches, lengths),
        "padding_waste_bucketed": _padding_waste(bucketed, lengths),
    }
    pick, bs = tuned.best, args.batch_size
    pick_name = f"tuner pick: {pick['num_workers']} workers, prefetch {pick['prefetch_factor']}"
    best_name = f"grid best: {best['num_workers']} workers, prefetch {best['prefetch_factor']}"
    out = [
        f"\nDataLoader on the example VLM's JPEG shards ({len(lengths)} samples, batch {bs}, "
        f"image {cfg.image_size}px, {budget} cores for this process)",
        f"{'':<38}{'samples/s':>10}",
        f"{'plain (num_workers=0)':<38}{report['plain_samples_per_sec']:>10.0f}",
        f"{pick_name:<38}{report['tuner_pick_samples_per_sec']:>10.0f}",
        f"{best_name:<38}{best['samples_per_sec']:>10.0f}",
        f"tuned / plain: {report['tuned_over_plain']:.2f}x; "
        f"pick / grid best: {report['pick_over_grid_best']:.3f} in the grid (best rounds); "
        f"{confirmed['pick_over_best']:.3f} timed side by side, {args.confirm_rounds} rounds, "
        "medians (goal >= 0.95)",
        f"tuning {tune_seconds:.1f} s vs grid {grid_seconds:.1f} s: "
        f"{report['tuning_over_grid_time']:.0%} (goal <= 20%)",
        f"padding waste, batches of {bs}: random {report['padding_waste_random']:.1%}, "
        f"bucketed {report['padding_waste_bucketed']:.1%}",
    ]
    print("\n".join(out))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
