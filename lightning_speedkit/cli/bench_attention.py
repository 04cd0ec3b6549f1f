"""``speedkit bench-attention``: each attention backend's time and memory against eager.

A thin parser over :func:`lightning_speedkit.attention.bench.bench_attention`: the device,
the key/value heads and ``--out`` are checked before any timing.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_speedkit.cli._flag_values import positive_float, positive_int
from lightning_speedkit.cli._output_paths import cannot_write, output_dir
from lightning_speedkit.cli._parser import CommandLineError

if TYPE_CHECKING:
    from lightning_speedkit.attention.bench import BenchRow
    from lightning_speedkit.cli._parser import Subparsers

NAME = "bench-attention"

#: bench_attention's argument names, as this command's flags.
FLAGS = {
    "seq_lens": "--seq", "head_dims": "--head-dim", "heads": "--heads",
    "kv_heads": "--kv-heads", "batch": "--batch", "backends": "--backends",
    "backend": "--backends", "dtype": "--dtype", "device": "--device",
    "repeats": "--repeats", "memory_limit_gib": "--memory-limit", "causal": "--no-causal",
}  # fmt: skip


def add_parser(subparsers: Subparsers) -> None:
    """The ``bench-attention`` subcommand and its flags."""
    from lightning_speedkit.attention.backends import BACKENDS

    bench = subparsers.add_parser(
        NAME,
        help="forward+backward time and memory of each attention backend vs eager",
        description=(
            "Time forward+backward of eager attention (explicit matmul, mask, softmax) and of "
            "each backend over sequence lengths, head dims and key/value heads (GQA); print "
            "time, memory and both relative to eager. Memory is the peak allocated on CUDA "
            "and the bytes saved for backward on CPU."
        ),
    )
    bench.add_argument(
        "--seq",
        type=positive_int,
        nargs="+",
        default=None,
        help="sequence lengths (default: 256-8192 on CUDA, 256-2048 on CPU)",
    )
    bench.add_argument(
        "--head-dim",
        type=positive_int,
        nargs="+",
        default=[64],
        help="head dimensions (default: %(default)s)",
    )
    bench.add_argument("--heads", type=positive_int, default=8, help="query heads (default: 8)")
    bench.add_argument(
        "--kv-heads",
        type=positive_int,
        nargs="+",
        default=[8, 2],
        help="key/value heads, each dividing --heads; fewer than --heads is GQA "
        "(default: %(default)s)",
    )
    bench.add_argument("--batch", type=positive_int, default=1, help="batch size (default: 1)")
    bench.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        default=["sdpa", "flash", "efficient", "cudnn", "math"],
        help="backends to compare with eager (default: %(default)s)",
    )
    bench.add_argument("--no-causal", action="store_true", help="bidirectional attention")
    bench.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="default: bfloat16 on CUDA, float32 on CPU",
    )
    bench.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="default: cuda if available, else cpu",
    )
    bench.add_argument(
        "--repeats",
        type=positive_int,
        default=5,
        help="timed repeats per shape, median kept (default: %(default)s)",
    )
    bench.add_argument(
        "--memory-limit",
        type=positive_float,
        default=8.0,
        help="skip shapes whose eager scores need more GiB (default: %(default)s)",
    )
    bench.add_argument("--out", default="bench_attention",
                       help="directory for results.json and the plot")  # fmt: skip


def _check_device_and_heads(args: argparse.Namespace) -> None:
    """Refuse ``--device cuda`` without a CUDA device, and key/value heads that do not divide."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise CommandLineError(
            "argument --device: cuda asked, and torch sees no CUDA device "
            "(torch.cuda.is_available() is False); use --device cpu"
        )
    for kv in args.kv_heads:
        if args.heads % kv:
            raise CommandLineError(
                f"argument --kv-heads: {kv} does not divide --heads {args.heads} "
                "(grouped-query attention shares each key/value head among the same "
                "number of query heads); give divisors of --heads"
            )


def run(args: argparse.Namespace) -> int:
    """Check the input and ``--out``, time every shape, print the table, write the files."""
    import torch

    from lightning_speedkit.attention.bench import bench_attention, format_table

    _check_device_and_heads(args)
    out = output_dir(args.out, "--out")
    rows = bench_attention(
        args.seq,
        args.head_dim,
        args.heads,
        args.kv_heads,
        args.batch,
        args.backends,
        causal=not args.no_causal,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        device=args.device,
        repeats=args.repeats,
        memory_limit_gib=args.memory_limit,
    )
    print(format_table(rows))
    _write_results(rows, out, causal=not args.no_causal)
    return 0


def _write_results(rows: list[BenchRow], out: Path, *, causal: bool) -> None:
    """``results.json`` (the rows and where they were measured) and the plot, under ``out``."""
    import platform
    from datetime import datetime, timezone

    import torch

    from lightning_speedkit import _imports
    from lightning_speedkit.attention.bench import plot, write_json

    device = rows[0].device
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "causal": causal,
    }
    try:
        write_json(rows, out / "results.json", meta)
        print(f"\nwrote {out / 'results.json'}")
        if _imports.MATPLOTLIB_AVAILABLE:
            print(f"wrote {plot(rows, out / 'attention.png')}")
        else:
            print("no plot: pip install 'lightning_speedkit[plot]' for one")
    except OSError as exc:
        raise cannot_write("--out", out, exc) from exc
