"""Step-time overhead of SpeedMonitor (and of Lightning's ThroughputMonitor) on the example VLM.

Three configurations train the same model on the same pre-decoded batches (so the
data pipeline adds no noise): no monitor, SpeedMonitor, and Lightning's
ThroughputMonitor. Runs are interleaved (A B C A B C ...) so that drift on a
shared machine hits all three alike, and the overhead is the ratio of median
step times measured side by side.

A neutral stopwatch callback times the steps after a warm-up long enough for
SpeedMonitor's FLOP counts (one slow step per distinct batch shape) to be over:
that is the steady-state overhead. The one-off cost of the counted steps is
reported separately, in milliseconds.

    python benchmarks/monitor_overhead.py                  # CPU, tiny VLM
    python benchmarks/monitor_overhead.py --accelerator gpu --size base --precision bf16-mixed

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor

from lightning_speedkit import SpeedMonitor, count_flops
from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule, VLMTask

CONFIGS = ("none", "speed_monitor", "throughput_monitor")


class Stopwatch(L.Callback):
    """Wall time of the steps after ``warmup``; waits for the device only at both ends."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = 0.0
        self.stop = 0.0
        self.steps = 0
        self.per_step: list[float] = []
        self._last = 0.0

    def _now(self, trainer: L.Trainer, sync: bool) -> float:
        if sync and trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps += 1
        cpu = trainer.strategy.root_device.type == "cpu"
        if self.steps == self.warmup:
            self.start = self._last = self._now(trainer, sync=True)
        elif self.steps > self.warmup:
            now = self._now(trainer, sync=False)
            if cpu:  # host time is device time on CPU
                self.per_step.append(now - self._last)
            self._last = now

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.stop = self._now(trainer, sync=True)

    @property
    def step_ms(self) -> float:
        if self.per_step:
            return 1e3 * statistics.median(self.per_step)
        return 1e3 * (self.stop - self.start) / max(1, self.steps - self.warmup)


class TimedSpeedMonitor(SpeedMonitor):
    """SpeedMonitor that also adds up the host time spent in its per-batch hooks.

    Steps that count FLOPs are left out (their one-off cost is reported apart);
    log-time work (reading events, the all-gather, logging) is included.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hook_seconds = 0.0
        self.hook_steps = 0
        self._t = 0.0

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        super().on_train_batch_start(*args, **kwargs)
        self._t = time.perf_counter() - start

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        counting = self._counts.counting
        start = time.perf_counter()
        super().on_train_batch_end(*args, **kwargs)
        if not counting:
            self.hook_seconds += self._t + time.perf_counter() - start
            self.hook_steps += 1


def _batches(args: argparse.Namespace, cfg: VLMConfig) -> list[dict[str, torch.Tensor]]:
    dm = VLMDataModule.for_model(cfg, args.data_dir, batch_size=args.batch_size, progress=False)
    dm.setup("fit")
    out = []
    for batch in dm.train_dataloader():
        batch.pop("num_skipped")
        out.append(batch)
        if len(out) == args.distinct_batches:
            return out
    return out


def run_once(
    name: str, args: argparse.Namespace, batches: list[Any], cfg: VLMConfig
) -> dict[str, Any]:
    torch.manual_seed(0)
    task = VLMTask(cfg, pad_id=CaptionTokenizer().pad_id)
    watch = Stopwatch(args.warmup)
    callbacks: list[L.Callback] = [watch]
    monitor: TimedSpeedMonitor | None = None
    if name == "speed_monitor":
        monitor = TimedSpeedMonitor(log_every_n_steps=args.log_every)
        callbacks.append(monitor)
    elif name == "throughput_monitor":
        callbacks.append(ThroughputMonitor(batch_size_fn=lambda b: b["images"].shape[0]))
    cycled = [batches[i % len(batches)] for i in range(args.warmup + args.steps)]
    loader = torch.utils.data.DataLoader(cycled, batch_size=None)  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as logs:
        trainer = L.Trainer(
            accelerator=args.accelerator, devices=1, precision=args.precision,
            max_steps=args.warmup + args.steps, logger=L.pytorch.loggers.CSVLogger(logs),
            callbacks=callbacks, log_every_n_steps=args.log_every, enable_checkpointing=False,
            limit_val_batches=0,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(task, train_dataloaders=loader)
    result: dict[str, Any] = {"config": name, "step_ms": watch.step_ms}
    if monitor is not None:
        result["flop_counts"] = len(monitor.flops.counted)
        result["hook_us_per_step"] = 1e6 * monitor.hook_seconds / max(1, monitor.hook_steps)
        result["mfu"] = monitor.summary["mfu"]
    return result


def counting_cost(batches: list[Any], cfg: VLMConfig) -> dict[str, float]:
    """One forward+backward plain and under the FLOP counter, best of 5 (CPU or CUDA)."""
    task = VLMTask(cfg, pad_id=CaptionTokenizer().pad_id)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    task.to(device)
    batch = {k: v.to(device) for k, v in batches[0].items()}

    def step() -> None:
        logits = task(batch["images"], batch["input_ids"][:, :-1])
        task._loss(logits, batch["input_ids"][:, 1:]).backward()

    def best_ms(fn: Any) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return 1e3 * min(times)

    step()
    return {"plain_step_ms": best_ms(step), "counted_step_ms": best_ms(lambda: count_flops(step))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="tiny", choices=("tiny", "small", "base"))
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=150, help="timed steps per run")
    parser.add_argument(
        "--warmup", type=int, default=30, help="untimed steps per run (covers FLOP counts)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs per configuration")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--distinct-batches", type=int, default=8)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (1: see docs)")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/monitor_overhead.json")
    )
    args = parser.parse_args(argv)
    if args.accelerator == "cpu":
        torch.set_num_threads(args.threads)

    cfg = VLMConfig.preset(args.size, CaptionTokenizer().vocab_size)
    batches = _batches(args, cfg)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats):
        order = CONFIGS[repeat % 3 :] + CONFIGS[: repeat % 3]  # rotate who goes first
        for name in order:
            runs[name].append(run_once(name, args, batches, cfg))
            print(
                f"  repeat {repeat + 1}/{args.repeats} {name:<19} "
                f"{runs[name][-1]['step_ms']:.2f} ms",
                file=sys.stderr,
                flush=True,
            )

    base = statistics.median(r["step_ms"] for r in runs["none"])
    rows = []
    for name in CONFIGS:
        median = statistics.median(r["step_ms"] for r in runs[name])
        spread = [r["step_ms"] for r in runs[name]]
        rows.append(
            {
                "step_ms_min": min(spread),
                "step_ms_max": max(spread),
                "config": name,
                "step_ms_median": median,
                "ratio_to_none": median / base,
                "overhead_pct": 100 * (median / base - 1),
                "step_ms_runs": [r["step_ms"] for r in runs[name]],
            }
        )
    device = (
        torch.cuda.get_device_name()
        if args.accelerator in ("gpu", "cuda")
        else platform.processor() or "cpu"
    )
    report = {
        "benchmark": "monitor_overhead",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "lightning": L.__version__,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "speed_monitor_flop_counts": runs["speed_monitor"][0].get("flop_counts"),
        "speed_monitor_hook_us_per_step": statistics.median(
            r["hook_us_per_step"] for r in runs["speed_monitor"]
        ),
        "flop_count_cost": counting_cost(batches, cfg),
    }
    print(
        f"\nmonitor overhead: VLM {args.size}, batch {args.batch_size}, "
        f"{args.accelerator} ({device}), "
        f"{args.repeats} interleaved runs x {args.steps} steps, log every {args.log_every}"
    )
    print(f"{'config':<20}{'median step (ms)':>18}{'runs min-max (ms)':>20}{'ratio':>8}")
    for row in rows:
        print(
            f"{row['config']:<20}{row['step_ms_median']:>18.2f}"
            f"{row['step_ms_min']:>13.2f}-{row['step_ms_max']:<6.2f}{row['ratio_to_none']:>8.3f}"
        )
    hook_us = report["speed_monitor_hook_us_per_step"]
    print(
        f"SpeedMonitor's hooks: {hook_us:.0f} us per step (log-time work included), "
        f"{hook_us / 10 / base:.3f}% of the {base:.1f} ms step"
    )
    cost = report["flop_count_cost"]
    print(
        f"one-off: a step under the FLOP counter takes {cost['counted_step_ms']:.1f} ms against "
        f"{cost['plain_step_ms']:.1f} ms plain; SpeedMonitor counted "
        f"{report['speed_monitor_flop_counts']} distinct batch shapes (max_flop_counts=8)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
