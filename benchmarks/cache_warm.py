"""How long filling a SampleCache takes: one sample after another, or warmed by workers.

An in-process cached loader decodes its first epoch one sample after another
(``warm(num_workers=0)`` reads the same way, without the training in between);
``SampleCache.warm(num_workers=N)`` reads in N processes. Each setting fills a fresh
cache of the example VLM's training split from its JPEG shards; settings run in
interleaved rounds and the table shows medians.

On a machine whose cores the training compute also uses (a CPU run), warming moves
the decoding before the first step rather than removing it: compare the seconds here
with what the first epoch lost to decoding. On a GPU machine the cores are otherwise
idle during the first epoch.

    python benchmarks/cache_warm.py

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

from lightning_speedkit.data import SampleCache
from lightning_speedkit.data.worker_search import cpu_budget
from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule

HERE = Path(__file__).resolve()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=("tiny", "small", "base"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="*", default=None,
                        help="worker counts to time (default: 1 up to the cores here)")  # fmt: skip
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", type=Path, default=HERE.parent / "results" / "cache_warm.json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    workers = args.workers or list(range(1, cpu_budget() + 1))
    settings = [0, *workers]

    config = VLMConfig.preset(args.size, CaptionTokenizer().vocab_size)
    dm = VLMDataModule.for_model(config, args.data_dir, batch_size=32)
    dm.prepare_data()
    dm.setup("fit")
    dataset = dm.datasets["train"]
    seconds: dict[int, list[float]] = {n: [] for n in settings}
    nbytes = 0
    for r in range(args.rounds):
        for n in settings if r % 2 == 0 else settings[::-1]:
            cache = SampleCache(dataset)
            start = time.perf_counter()
            read = cache.warm(num_workers=n, progress=False)
            seconds[n].append(time.perf_counter() - start)
            if read != len(dataset):
                raise RuntimeError(f"warm kept {read} of {len(dataset)} samples")
            nbytes = cache.nbytes

    serial = statistics.median(seconds[0])
    rows = [
        {
            "num_workers": n,
            "seconds": statistics.median(seconds[n]),
            "samples_per_sec": len(dataset) / statistics.median(seconds[n]),
            "speedup": serial / statistics.median(seconds[n]),
            "rounds": seconds[n],
        }
        for n in settings
    ]
    print(f"filling a SampleCache: VLM {args.size}, {len(dataset):,} samples "
          f"({nbytes / 2**20:.0f} MiB), {args.rounds} rounds, medians")  # fmt: skip
    print(f"{'':<34}{'seconds':>9}{'samples/s':>11}{'speed-up':>10}")
    for row in rows:
        n = row["num_workers"]
        label = "one after another (in-process)" if n == 0 else f"warm(num_workers={n})"
        print(f"{label:<34}{row['seconds']:>9.2f}{row['samples_per_sec']:>11,.0f}"
              f"{row['speedup']:>9.2f}x")  # fmt: skip
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "cores": cpu_budget(),
        "size": args.size,
        "samples": len(dataset),
        "cache_mib": nbytes / 2**20,
        "rounds": args.rounds,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
