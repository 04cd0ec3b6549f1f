"""``speedkit bench-allreduce``: all-reduce time and bus bandwidth over message sizes.

A thin parser over :func:`lightning_speedkit.distributed.allreduce_bench.bench_allreduce`:
the processes, the sizes and ``--json`` are checked before any process starts.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from lightning_speedkit.cli._flag_values import integer, non_negative_int, positive_int
from lightning_speedkit.cli._output_paths import cannot_write, output_file
from lightning_speedkit.cli._parser import CommandLineError

if TYPE_CHECKING:
    from lightning_speedkit.cli._parser import Subparsers

NAME = "bench-allreduce"

#: bench_allreduce's argument names, as this command's flags.
FLAGS = {
    "backend": "--backend", "world_size": "--nprocs", "sizes": "--sizes",
    "iters": "--iters", "warmup": "--warmup",
}  # fmt: skip

_DEFAULT_SIZES = ("4KB", "64KB", "1MB", "16MB", "64MB")


def _process_count(text: str) -> int:
    return integer(text, "at least 2 (an all-reduce needs two processes)", 2)


def _message_size(text: str) -> int:
    from lightning_speedkit.distributed.allreduce_bench import parse_size
    from lightning_speedkit.errors import SpeedkitConfigError

    try:
        return parse_size(text)
    except SpeedkitConfigError as exc:  # "Cannot read the size ..." after "argument --sizes:"
        message = str(exc).rstrip(".")
        raise argparse.ArgumentTypeError(message[0].lower() + message[1:]) from None
    except OverflowError:  # parse_size's int() of an infinite number
        raise argparse.ArgumentTypeError(
            f"must be a finite size, e.g. 4KB, 16MB or 1GB, got {text!r}"
        ) from None


def add_parser(subparsers: Subparsers) -> None:
    """The ``bench-allreduce`` subcommand and its flags."""
    bench = subparsers.add_parser(
        NAME,
        help="all-reduce time and bus bandwidth over message sizes (gloo or NCCL)",
        description=(
            "Time float32 all-reduces on local processes and print time, algorithm "
            "bandwidth and bus bandwidth (algbw x 2(n-1)/n, as nccl-tests report it)."
        ),
    )
    bench.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="gloo (CPU) or nccl (a GPU per process) (default: %(default)s)",
    )
    bench.add_argument(
        "--nprocs", type=_process_count, default=2, help="processes, 2 or more (default: 2)"
    )
    bench.add_argument("--sizes", nargs="+", type=_message_size, default=None,
                       help=f"message sizes (default: {' '.join(_DEFAULT_SIZES)})")  # fmt: skip
    bench.add_argument("--iters", type=positive_int, default=20, help="timed calls per size")
    bench.add_argument("--warmup", type=non_negative_int, default=5, help="untimed calls per size")
    bench.add_argument("--json", default=None, help="also write the rows to this JSON file")


def run(args: argparse.Namespace) -> int:
    """Check the GPUs and ``--json``, time the all-reduces, print (and write) the rows."""
    import json

    import torch

    from lightning_speedkit.distributed.allreduce_bench import (
        bench_allreduce,
        format_table,
        parse_size,
        to_json,
    )

    if args.backend == "nccl" and torch.cuda.device_count() < args.nprocs:
        raise CommandLineError(
            f"argument --backend: nccl needs one GPU per process: --nprocs {args.nprocs}, "
            f"{torch.cuda.device_count()} GPU(s) visible; use --backend gloo or fewer --nprocs"
        )
    out = output_file(args.json, "--json") if args.json else None
    sizes = args.sizes or [parse_size(s) for s in _DEFAULT_SIZES]
    rows = bench_allreduce(args.backend, args.nprocs, sizes, args.iters, args.warmup)
    print(format_table(rows))
    if out is not None:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(to_json(rows), indent=2))
        except OSError as exc:
            raise cannot_write("--json", out, exc) from exc
    return 0
