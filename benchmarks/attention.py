"""Attention backends vs eager, and the example VLM trained with and without AttentionSwap.

Part 1 is ``speedkit bench-attention`` (forward+backward time and memory per
backend over sequence lengths, multi-head and GQA). Part 2 trains the example
VLM (training steps on fixed batches: forward, backward, AdamW) with its own
eager attention and after ``swap_attention(model, "auto")``, interleaved
(plain, swapped, plain, ...) so drift hits both alike; the ratio of median step
times is the end-to-end speed-up. Two sequence lengths: the ``small`` preset as
is (64 image + 40 text tokens) and with 128-pixel images (256 image tokens).

    python benchmarks/attention.py                      # CPU
    python benchmarks/attention.py --device cuda --size base --dtype bfloat16

Prints tables and writes JSON (``--out``) and a plot (``--plot``); the JSON keeps each
swapped module's parity check (status, kernel, error against float32).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_speedkit import _imports, swap_attention
from lightning_speedkit.attention.bench import bench_attention, format_table, plot
from speedkit_examples.vlm import VLM, VLMConfig


def _train_steps(model: VLM, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> float:
    """Median seconds of a training step (forward, loss, backward, AdamW)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images, ids = batch
    times = []
    for _ in range(steps):
        if images.is_cuda:
            torch.cuda.synchronize()  # SYNC: benchmark timing
        start = time.perf_counter()
        logits = model(images, ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if images.is_cuda:
            torch.cuda.synchronize()  # SYNC: benchmark timing
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def end_to_end(
    size: str,
    image_size: int,
    batch: int,
    device: torch.device,
    dtype: torch.dtype,
    rounds: int,
    steps: int,
) -> dict[str, Any]:
    torch.manual_seed(0)
    config = VLMConfig.preset(size, vocab_size=35, image_size=image_size)  # type: ignore[arg-type]
    plain = VLM(config).to(device, dtype)
    swapped = copy.deepcopy(plain)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, image_size, image_size, generator=generator).to(device, dtype)
    ids = torch.randint(0, 35, (batch, config.max_text_len), generator=generator).to(device)
    report = swap_attention(swapped, "auto", sample=(images, ids[:, :-1]))
    results: dict[str, list[float]] = {"plain": [], "swapped": []}
    for _ in range(rounds):  # interleaved
        results["plain"].append(_train_steps(plain, (images, ids), steps))
        results["swapped"].append(_train_steps(swapped, (images, ids), steps))
    plain_s, swapped_s = (statistics.median(results[k]) for k in ("plain", "swapped"))
    return {
        "size": size,
        "image_size": image_size,
        "tokens": config.num_image_tokens + config.max_text_len - 1,
        "batch": batch,
        "plain_step_ms": plain_s * 1e3,
        "swapped_step_ms": swapped_s * 1e3,
        "speedup": plain_s / swapped_s,
        "plain_samples_per_s": batch / plain_s,
        "swapped_samples_per_s": batch / swapped_s,
        "swapped_modules": len(report.swapped),
        "reverted_modules": len(report.reverted),
        "backends": sorted({m.backend or "" for m in report.modules}),
        "parity": report.as_dict()["modules"],  # each module's check: status, kernel, error
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--size", default="small", choices=("tiny", "small", "base"))
    parser.add_argument("--image-sizes", type=int, nargs="+", default=None,
                        help="image sides, end to end (default: the preset's and 2x)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per round")
    parser.add_argument("--seq", type=int, nargs="+", default=None, help="bench-attention lengths")
    parser.add_argument("--repeats", type=int, default=3, help="bench-attention repeats")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64], help="bench-attention")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/attention.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/assets/attention_cpu.png"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32
    )  # fmt: skip

    rows = bench_attention(
        args.seq,
        head_dims=args.head_dims,
        device=device,
        dtype=dtype,
        repeats=args.repeats,
        progress=False,
    )
    print(format_table(rows))
    base = VLMConfig.preset(args.size, vocab_size=35).image_size  # type: ignore[arg-type]
    image_sizes = args.image_sizes or [base, 2 * base]
    runs = [
        end_to_end(args.size, side, args.batch, device, dtype, args.rounds, args.steps)
        for side in image_sizes
    ]
    print("\n| model | tokens | plain ms/step | swapped ms/step | speed-up | swapped (reverted) |")
    print("|---|---:|---:|---:|---:|---|")
    for r in runs:
        print(
            f"| {r['size']} @ {r['image_size']}px | {r['tokens']} | {r['plain_step_ms']:.1f} "
            f"| {r['swapped_step_ms']:.1f} | {r['speedup']:.2f}x "
            f"| {r['swapped_modules']} ({r['reverted_modules']}) |"
        )
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": name,
        "dtype": str(dtype),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "command": " ".join(["python", "benchmarks/attention.py", *(argv or sys.argv[1:])]),
        "attention": [vars(r) for r in rows],
        "end_to_end": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    if _imports.MATPLOTLIB_AVAILABLE:
        print(f"wrote {plot(rows, args.plot)}")
    return result


if __name__ == "__main__":
    main()
