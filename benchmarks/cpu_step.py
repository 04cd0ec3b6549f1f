"""Where a training step of the example VLM goes on CPU, and what each lever buys.

``speedkit demo`` on a CPU compares plain Lightning with the kit. This benchmark takes
the step apart, side by side in one process, so that the demo's speed-up (and its
limit) can be read off:

- data: one batch loaded in the training process, decoded from the JPEG shards (plain
  Lightning's loader) and served from ``SampleCache`` (the kit's, after the first epoch);
- compute: forward, loss, backward and the task's AdamW step on fixed batches, for the
  model as written (plain), with its attention swapped by ``swap_attention("auto")``
  (what AttentionSwap does), then also with the AdamW fused (``fuse_optimizers``, what
  FusedOptimizer does) and then also with the repeated blocks compiled in place
  (``compile_blocks``, what RegionalCompile does); under bf16 autocast, and compiled
  whole with ``torch.compile`` (those two change what the user runs or how: not in the
  kit's demo);
- each compute variant's first-step gradient against the plain model's, so that a
  speed-up that changes the numerics shows as such;
- the plain step's operators by family (torch profiler, self time).

Variants are timed in interleaved rounds (each round runs every variant once) and
reported as medians; a speed-up is the median of the per-round ratios, each taken
between runs a fraction of a second apart, so that a slow spell of the machine
(common on shared ones) cancels out of it.

    python benchmarks/cpu_step.py                 # tiny VLM, batch 32: the demo's step
    python benchmarks/cpu_step.py --no-compile    # skip torch.compile (about a minute)

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from lightning_speedkit.attention import swap_attention
from lightning_speedkit.compute import compile_blocks, fuse_optimizers
from lightning_speedkit.data import SampleCache
from speedkit_examples.vlm.data import VLMDataModule
from speedkit_examples.vlm.model import VLMConfig
from speedkit_examples.vlm.task import VLMTask
from speedkit_examples.vlm.tokenizer import CaptionTokenizer

HERE = Path(__file__).resolve()
W = 36  # the table's first column
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear")


def _rel_error(a: Tensor, b: Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


class ComputeVariant:
    """One way of running the step: a copy of the task, its optimizer, a context."""

    def __init__(
        self,
        name: str,
        task: VLMTask,
        autocast: bool = False,
        compiled: bool = False,
        fused: bool = False,
        regional: bool = False,
    ) -> None:
        self.name = name
        self.task = task
        config = task.configure_optimizers()
        self.optimizer = config["optimizer"]
        if fused:
            (switch,) = fuse_optimizers([self.optimizer])
            assert switch.implementation is not None, switch.reason
        if regional:
            assert compile_blocks(task.model), "no repeated blocks to compile"
        self.autocast = autocast
        self.model: Callable[..., Tensor] = task.model
        if compiled:
            self.model = torch.compile(task.model)  # type: ignore[assignment]
        self.times: list[float] = []

    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        ids = batch["input_ids"]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(batch["images"], ids[:, :-1])
        return self.task._loss(logits.float(), ids[:, 1:])

    def step(self, batch: dict[str, Tensor]) -> None:
        self.loss(batch).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def first_grad(self, batch: dict[str, Tensor]) -> Tensor:
        self.task.zero_grad(set_to_none=True)
        self.loss(batch).backward()
        grad = torch.cat([p.grad.flatten() for p in self.task.parameters() if p.grad is not None])
        self.task.zero_grad(set_to_none=True)
        return grad.double()


def _time_loading(
    load: Callable[[list[int]], Any], batches: list[list[int]], rounds: list[float]
) -> None:
    start = time.perf_counter()
    for indices in batches:
        load(indices)
    rounds.append((time.perf_counter() - start) / len(batches))


def _operator_shares(variant: ComputeVariant, batches: list[dict[str, Tensor]]) -> dict[str, float]:
    """Self CPU time of one variant's steps by operator family, as shares of the total."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches:
            variant.step(batch)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / total
    # The optimizer's own ops run inside its step's record: count them by that record's
    # total, not by operator name.
    optimizer = sum(e.cpu_time_total for e in events if e.key.startswith("Optimizer.step")) / total
    return {
        "matmul": matmul,
        "optimizer (AdamW)": optimizer,
        "everything else": 1 - matmul - optimizer,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="tiny", help="VLM preset (default: the demo's tiny)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=4, help="fixed batches per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", type=Path, default=HERE.parent / "results" / "cpu_step.json")
    args = parser.parse_args(argv)
    for flag in ("batch_size", "batches", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be at least 1")

    L.seed_everything(args.seed, verbose=False)
    tokenizer = CaptionTokenizer()
    cfg = VLMConfig.preset(args.size, tokenizer.vocab_size)  # type: ignore[arg-type]
    dm = VLMDataModule.for_model(cfg, args.data_dir, batch_size=args.batch_size, progress=False)
    dm.prepare_data()
    dm.setup("fit")
    dataset = dm.datasets["train"]
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed))
    index_batches = [
        order[i * args.batch_size : (i + 1) * args.batch_size].tolist() for i in range(args.batches)
    ]
    if len(index_batches[-1]) < args.batch_size:
        parser.error(f"--batches x --batch-size: more than the corpus's {len(dataset)} samples")

    # Data: decoding every sample (plain) against the cache (the kit, after epoch 1).
    cache = SampleCache(dataset)
    for indices in index_batches:
        [cache[i] for i in indices]  # warm: what the first epoch does
    batches = [
        {k: v for k, v in dm.collate([dataset[i] for i in idx]).items() if k != "num_skipped"}
        for idx in index_batches
    ]

    initial = VLMTask(cfg, pad_id=tokenizer.pad_id)
    plain = ComputeVariant("plain (as written)", copy.deepcopy(initial))
    swapped = copy.deepcopy(initial)
    report = swap_attention(
        swapped, "auto", sample=(batches[0]["images"], batches[0]["input_ids"][:, :-1])
    )
    kernels = sorted({m.backend or "?" for m in report.modules if m.status != "reverted"})
    # Every variant gets its own copy of the swapped task, made before any is used.
    copies = {name: copy.deepcopy(swapped) for name in ("fused", "regional", "compiled")}
    variants = [
        plain,
        ComputeVariant("AttentionSwap", swapped),
        ComputeVariant("AttentionSwap + FusedOptimizer (the kit on CPU)", copies["fused"],
                       fused=True),
        ComputeVariant("bf16 autocast", copy.deepcopy(initial), autocast=True),
    ]  # fmt: skip
    if not args.no_compile:
        variants.insert(
            3,
            ComputeVariant("AttentionSwap + Fused + RegionalCompile", copies["regional"],
                           fused=True, regional=True),
        )  # fmt: skip
        variants.append(ComputeVariant("torch.compile", copy.deepcopy(initial), compiled=True))
        # swap_attention's documented order: swap first, then compile.
        variants.append(
            ComputeVariant("AttentionSwap + compile", copies["compiled"], compiled=True)
        )
    print(
        f"VLM {args.size}, batch {args.batch_size}, {args.batches} batches x {args.rounds} "
        f"interleaved rounds, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )

    # Every variant's first gradient, from the same weights; torch.compile compiles here.
    reference = plain.first_grad(batches[0])
    grad_errors: dict[str, float] = {}
    compile_seconds = None
    for v in variants:
        start = time.perf_counter()
        grad_errors[v.name] = _rel_error(v.first_grad(batches[0]), reference)
        # RegionalCompile's variant compiles before it: this figure is with inductor's
        # caches warmed by that (and by earlier runs on the machine)
        if v.name == "torch.compile":
            compile_seconds = time.perf_counter() - start

    decode: list[float] = []
    cached: list[float] = []
    for v in variants:  # warm-up: allocator, oneDNN primitives
        for batch in batches[:2]:
            v.step(batch)
    for _ in range(args.rounds):
        _time_loading(lambda idx: dm.collate([dataset[i] for i in idx]), index_batches, decode)
        _time_loading(lambda idx: dm.collate([cache[i] for i in idx]), index_batches, cached)
        for v in variants:
            start = time.perf_counter()
            for batch in batches:
                v.step(batch)
            v.times.append((time.perf_counter() - start) / len(batches))
    shares = _operator_shares(plain, batches)

    ms = 1e3
    data_plain, data_kit = statistics.median(decode) * ms, statistics.median(cached) * ms
    compute = {v.name: statistics.median(v.times) * ms for v in variants}
    speedup = {
        v.name: statistics.median(p / t for p, t in zip(plain.times, v.times, strict=True))
        for v in variants
    }
    cache_speedup = statistics.median(d / c for d, c in zip(decode, cached, strict=True))
    base = compute[plain.name]
    print(
        f"\n{'per batch of ' + str(args.batch_size):<{W}}{'ms':>8}{'x plain':>9}{'grad error':>12}"
    )
    print(f"{'data: decode (plain)':<{W}}{data_plain:>8.2f}")
    print(f"{'data: SampleCache (kit)':<{W}}{data_kit:>8.2f}{cache_speedup:>8.1f}x")
    for v in variants:
        print(
            f"{'compute: ' + v.name:<{W}}{compute[v.name]:>8.2f}{speedup[v.name]:>8.2f}x"
            f"{grad_errors[v.name]:>12.1e}"
        )
    print(f"\nswapped attention kernels: {', '.join(kernels) or 'none'}")
    if compile_seconds is not None:
        print(f"torch.compile: {compile_seconds:.0f} s to compile before the first step")
    print(
        "plain step by operator (self time): "
        + ", ".join(f"{k} {v:.0%}" for k, v in shares.items())
    )

    kit = variants[2]  # what the demo's kit runs on CPU
    plain_steps = [d + t for d, t in zip(decode, plain.times, strict=True)]
    kit_steps = [c + t for c, t in zip(cached, kit.times, strict=True)]
    kit_speedup = statistics.median(p / k for p, k in zip(plain_steps, kit_steps, strict=True))
    no_wait = statistics.median(p / t for p, t in zip(plain_steps, plain.times, strict=True))
    plain_step, kit_step = statistics.median(plain_steps) * ms, statistics.median(kit_steps) * ms
    print(
        f"\nplain step {plain_step:.1f} ms = data {data_plain:.1f} + compute {base:.1f}"
        f"\nkit step   {kit_step:.1f} ms = data {data_kit:.1f} + compute {compute[kit.name]:.1f}"
        f"\nkit / plain: {kit_speedup:.2f}x; a loader alone (no data wait at all): {no_wait:.2f}x"
    )
    needed = plain_step / 2 - data_kit  # the compute a kit step at 2x plain may take
    if needed > 0:
        print(f"2x plain needs the compute {base / needed:.2f}x faster than plain's")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "size": args.size,
                "batch_size": args.batch_size,
                "batches": args.batches,
                "rounds": args.rounds,
                "data_ms": {"decode": data_plain, "sample_cache": data_kit},
                "data_rounds_ms": {
                    "decode": [t * ms for t in decode],
                    "sample_cache": [t * ms for t in cached],
                },
                "compute_ms": compute,
                "compute_speedup": speedup,
                "sample_cache_speedup": cache_speedup,
                "compute_rounds_ms": {v.name: [t * ms for t in v.times] for v in variants},
                "grad_rel_error": grad_errors,
                "swapped_kernels": kernels,
                "compile_seconds": compile_seconds,
                "plain_operator_shares": shares,
                "plain_step_ms": plain_step,
                "kit_step_ms": kit_step,
                "kit_speedup": kit_speedup,
                "loader_alone_speedup": no_wait,
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
