"""The example VLM with its vision tower frozen: training steps plain and with the feature cache.

Both sides train the same model from the same seed on the same decoded batches (decoded
once, before timing, so that only the step is measured: this slice of the cache skips
the tower's forward, not yet the loader's decoding). Per side: epoch 0 fills the store,
epoch 1 verifies on its first reuse and serves, epochs 2 and later are timed. Sides run
in interleaved rounds, one thread each, and the table shows medians.

The figures: ``s``, the share of the plain step spent in the tower's forward (timed by
hooks around it); the ideal speed-up ``1 / (1 - s)`` (a step can lose at most the
tower); the speed-up measured; and the store's memory.

    python benchmarks/frozen_tower.py --size tiny

Prints a table and writes JSON (``--out``).
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

import torch
import torch.nn.functional as F

from lightning_speedkit.compute._frozen_core import cache_frozen_features
from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule, VLMTask

HERE = Path(__file__).resolve()


def _batches(config: VLMConfig, data_dir: str | None, count: int, size: int) -> list[Any]:
    """``count`` decoded batches of ``size`` samples: (dataset indices, batch)."""
    dm = VLMDataModule.for_model(config, data_dir, batch_size=size, progress=False)
    dm.prepare_data()
    dm.setup("fit")
    dataset = dm.datasets["train"]
    batches = []
    for b in range(count):
        indices = list(range(b * size, (b + 1) * size))
        batches.append((indices, dm.collate([dataset[i] for i in indices])))
    return batches


def _side(config: VLMConfig, batches: list[Any], epochs: int, cached: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    task = VLMTask(config, pad_id=CaptionTokenizer().pad_id)
    optimizer = task.configure_optimizers()["optimizer"]
    cache = cache_frozen_features(task, ["model.vision"]) if cached else None
    tower = {"seconds": 0.0, "start": 0.0}
    vision = task.model.vision
    vision.register_forward_pre_hook(lambda *_: tower.update(start=time.perf_counter()))
    vision.register_forward_hook(
        lambda *_: tower.update(seconds=tower["seconds"] + time.perf_counter() - tower["start"])
    )
    step_seconds, tower_seconds, losses = 0.0, 0.0, []
    for epoch in range(epochs):
        for indices, batch in batches:
            tower["seconds"], began = 0.0, time.perf_counter()
            with cache.keys(indices) if cache is not None else _nothing():
                ids = batch["input_ids"]
                logits = task(batch["images"], ids[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), ignore_index=0)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            if epoch >= 2:
                step_seconds += time.perf_counter() - began
                tower_seconds += tower["seconds"]
            losses.append(loss.item())
    counts = cache.counts() if cache is not None else {}
    return {
        "step_seconds": step_seconds,
        "tower_seconds": tower_seconds,
        "losses": losses,
        "hits": counts.get("hits", 0),
        "misses": counts.get("misses", 0),
        "store_bytes": counts.get("store_bytes", 0),
    }


class _nothing:  # noqa: N801 - a context that does nothing, named as one reads it
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def measure(
    size: str, data_dir: str | None, batches: int, batch_size: int, epochs: int, rounds: int
) -> dict[str, Any]:
    config = VLMConfig.preset(size, CaptionTokenizer().vocab_size, freeze_vision=True)  # type: ignore[arg-type]
    data = _batches(config, data_dir, batches, batch_size)
    timed_steps = batches * (epochs - 2)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "cached": []}
    for r in range(rounds):
        for side in ("plain", "cached") if r % 2 == 0 else ("cached", "plain"):
            runs[side].append(_side(config, data, epochs, cached=side == "cached"))
    plain_rate = statistics.median(timed_steps / run["step_seconds"] for run in runs["plain"])
    cached_rate = statistics.median(timed_steps / run["step_seconds"] for run in runs["cached"])
    share = statistics.median(run["tower_seconds"] / run["step_seconds"] for run in runs["plain"])
    ideal = 1 / (1 - share)
    speedup = cached_rate / plain_rate
    last = runs["cached"][-1]
    return {
        "size": size,
        "batch_size": batch_size,
        "batches": batches,
        "epochs": epochs,
        "rounds": rounds,
        "timed_steps": timed_steps,
        "plain_steps_per_sec": plain_rate,
        "cached_steps_per_sec": cached_rate,
        "tower_share": share,
        "ideal_speedup": ideal,
        "speedup": speedup,
        "share_of_ideal": (speedup - 1) / (ideal - 1) if ideal > 1 else None,
        "same_losses": all(
            p["losses"] == c["losses"] for p, c in zip(runs["plain"], runs["cached"], strict=True)
        ),
        "hits": last["hits"],
        "misses": last["misses"],
        "store_bytes": last["store_bytes"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", nargs="+", default=["tiny"], choices=("tiny", "small", "base"))
    parser.add_argument("--batches", type=int, default=8, help="batches per epoch")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4, help="at least 3: 2 are warm-up")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", type=Path, default=HERE.parent / "results" / "frozen_tower.json")
    args = parser.parse_args(argv)
    if args.epochs < 3 or args.rounds < 1 or args.batches < 1:
        parser.error("--epochs must be at least 3, --rounds and --batches at least 1")
    torch.set_num_threads(1)  # a shared machine: one thread, ratios measured side by side
    rows = [
        measure(size, args.data_dir, args.batches, args.batch_size, args.epochs, args.rounds)
        for size in args.size
    ]
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} thread, "
        f"torch {torch.__version__}",
        "rows": rows,
    }
    print(
        f"{'size':<6} {'plain/s':>8} {'cached/s':>9} {'tower s':>8} {'ideal':>6} "
        f"{'speed-up':>9} {'of ideal':>9} {'store MiB':>10} {'same loss':>9}"
    )
    for row in rows:
        of_ideal = "-" if row["share_of_ideal"] is None else f"{row['share_of_ideal']:.0%}"
        print(
            f"{row['size']:<6} {row['plain_steps_per_sec']:>8.2f} "
            f"{row['cached_steps_per_sec']:>9.2f} "
            f"{row['tower_share']:>8.1%} {row['ideal_speedup']:>6.2f} {row['speedup']:>9.2f} "
            f"{of_ideal:>9} {row['store_bytes'] / 2**20:>10.2f} {row['same_losses']!s:>9}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
