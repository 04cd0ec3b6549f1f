"""Per-step cost of ProfilerSchedule outside its profiling windows, on the example VLM.

Two configurations train the tiny VLM on the same fixed batches: no callback, and
``ProfilerSchedule`` whose window never comes (``skip_first`` past the run), so what
is measured is what every un-profiled step pays: the profiler object stepped and the
callback's hooks. Runs are interleaved and the overhead is the ratio of median step
times; the callback's own hook time per step is measured directly too.

    python benchmarks/profiler_overhead.py
    python benchmarks/profiler_overhead.py --accelerator gpu --size base --precision bf16-mixed

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks share one stopwatch
from monitor_overhead import Stopwatch

from lightning_speedkit import ProfilerSchedule
from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMTask

CONFIGS = ("none", "profiler_idle")


class TimedProfilerSchedule(ProfilerSchedule):
    """ProfilerSchedule that adds up the host time of its per-batch hooks."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hook_seconds = 0.0
        self.hook_calls = 0

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        super().on_train_batch_start(*args, **kwargs)
        self.hook_seconds += time.perf_counter() - start

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        super().on_train_batch_end(*args, **kwargs)
        self.hook_seconds += time.perf_counter() - start
        self.hook_calls += 1


def batches(cfg: VLMConfig, batch_size: int, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        {"images": torch.randn(batch_size, 3, cfg.image_size, cfg.image_size, generator=g),
         "input_ids": torch.randint(4, cfg.vocab_size, (batch_size, cfg.max_text_len),
                                    generator=g)}
        for _ in range(n)
    ]  # fmt: skip


def run_once(
    name: str, args: argparse.Namespace, data: list[Any], cfg: VLMConfig
) -> dict[str, Any]:
    torch.manual_seed(0)
    task = VLMTask(cfg, pad_id=CaptionTokenizer().pad_id)
    watch = Stopwatch(args.warmup)
    callbacks: list[L.Callback] = [watch]
    profiler = None
    if name == "profiler_idle":
        profiler = TimedProfilerSchedule(skip_first=10**9, dirpath=args.work)
        callbacks.append(profiler)
    steps = args.warmup + args.steps
    loader = torch.utils.data.DataLoader(
        [data[i % len(data)] for i in range(steps)],
        batch_size=None,  # type: ignore[arg-type]
    )
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=1, precision=args.precision, max_steps=steps,
        logger=False, callbacks=callbacks, enable_checkpointing=False, limit_val_batches=0,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(task, train_dataloaders=loader)
    result: dict[str, Any] = {"config": name, "step_ms": watch.step_ms}
    if profiler is not None:
        result["hook_us_per_step"] = 1e6 * profiler.hook_seconds / max(1, profiler.hook_calls)
        result["traces"] = len(profiler.traces)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="tiny", choices=("tiny", "small", "base"))
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=150, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs per config")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    parser.add_argument("--work", default="/tmp/speedkit_profiler_overhead")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/profiler_overhead.json")
    )
    args = parser.parse_args(argv)
    if args.accelerator == "cpu":
        torch.set_num_threads(args.threads)
    cfg = VLMConfig.preset(args.size, CaptionTokenizer().vocab_size)
    data = batches(cfg, args.batch_size, 8)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats):
        for name in CONFIGS[repeat % 2 :] + CONFIGS[: repeat % 2]:  # alternate who goes first
            runs[name].append(run_once(name, args, data, cfg))
            print(f"  repeat {repeat + 1}/{args.repeats} {name:<14} "
                  f"{runs[name][-1]['step_ms']:.2f} ms", file=sys.stderr, flush=True)  # fmt: skip
    base = statistics.median(r["step_ms"] for r in runs["none"])
    rows = [
        {"config": name,
         "step_ms_median": statistics.median(r["step_ms"] for r in runs[name]),
         "step_ms_runs": [r["step_ms"] for r in runs[name]],
         "ratio_to_none": statistics.median(r["step_ms"] for r in runs[name]) / base}
        for name in CONFIGS
    ]  # fmt: skip
    hook_us = statistics.median(r["hook_us_per_step"] for r in runs["profiler_idle"])
    device = (torch.cuda.get_device_name() if args.accelerator in ("gpu", "cuda")
              else platform.processor() or "cpu")  # fmt: skip
    report = {
        "benchmark": "profiler_overhead",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "hook_us_per_step": hook_us,
        "hook_share_of_step": hook_us / 1e3 / base,
        "traces_written": sum(r["traces"] for r in runs["profiler_idle"]),
    }
    print(f"\nProfilerSchedule outside its windows: VLM {args.size}, batch {args.batch_size}, "
          f"{args.accelerator}, {args.repeats} interleaved runs x {args.steps} steps")  # fmt: skip
    print(f"{'config':<16}{'median step (ms)':>18}{'ratio':>8}")
    for row in rows:
        print(f"{row['config']:<16}{row['step_ms_median']:>18.2f}{row['ratio_to_none']:>8.3f}")
    print(f"hooks: {hook_us:.1f} us per step ({100 * report['hook_share_of_step']:.3f}% of a step)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
