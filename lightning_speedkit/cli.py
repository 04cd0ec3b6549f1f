"""The ``speedkit`` command.

Each subcommand is a thin argument parser over a function of the package; only
subcommands that exist are listed by ``speedkit --help``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_speedkit.__about__ import __version__


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _add_demo(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from lightning_speedkit._demo import DemoConfig

    defaults = DemoConfig()
    demo = subparsers.add_parser(
        "demo",
        help="train the example VLM twice, plain Lightning vs the kit, and compare",
        description=(
            "Train the example VLM (ViT encoder, MLP projector, causal decoder) on the "
            "embedded synthetic caption corpus (written to the cache on first use) twice: "
            "plain Lightning, then with the kit (NumWorkersTuner), both measured by "
            "SpeedMonitor, and print them side by side."
        ),
    )
    demo.add_argument(
        "--steps",
        type=_positive_int,
        default=defaults.steps,
        help="optimizer steps per run (default: %(default)s; both runs: ~3 minutes on 2 cores)",
    )
    demo.add_argument(
        "--size",
        choices=("tiny", "small", "base"),
        default=defaults.size,
        help="model preset (default: %(default)s)",
    )
    demo.add_argument(
        "--accelerator",
        default=defaults.accelerator,
        help="Lightning accelerator: cpu, gpu, auto (default: %(default)s)",
    )
    demo.add_argument(
        "--devices",
        type=_positive_int,
        default=defaults.devices,
        help="devices (processes); more than 1 trains with DDP (default: %(default)s)",
    )
    demo.add_argument(
        "--precision",
        default=defaults.precision,
        help="Lightning precision, e.g. 32-true, bf16-mixed (default: %(default)s)",
    )
    demo.add_argument(
        "--batch-size",
        type=_positive_int,
        default=defaults.batch_size,
        help="samples per batch per device (default: %(default)s)",
    )
    demo.add_argument(
        "--num-workers",
        type=_non_negative_int,
        default=defaults.num_workers,
        help="DataLoader workers of the plain run (default: %(default)s)",
    )
    demo.add_argument("--only", choices=("plain", "kit"), default=None, help="do one run only")
    demo.add_argument(
        "--data-dir",
        default=None,
        help="where the example corpus is cached (default: ~/.cache/lightning_speedkit/vlm)",
    )
    demo.add_argument(
        "--output-dir",
        default=defaults.output_dir,
        help="logs and results of the run (default: %(default)s)",
    )
    demo.add_argument(
        "--seed", type=int, default=defaults.seed, help="random seed (default: %(default)s)"
    )


def _add_bench_allreduce(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = subparsers.add_parser(
        "bench-allreduce",
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
        "--nprocs", type=_positive_int, default=2, help="processes (default: %(default)s)"
    )
    bench.add_argument("--sizes", nargs="+", default=["4KB", "64KB", "1MB", "16MB", "64MB"],
                       help="message sizes (default: %(default)s)")  # fmt: skip
    bench.add_argument("--iters", type=_positive_int, default=20, help="timed calls per size")
    bench.add_argument("--warmup", type=_non_negative_int, default=5, help="untimed calls per size")
    bench.add_argument("--json", default=None, help="also write the rows to this JSON file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="speedkit",
        description="lightning_speedkit: measure and speed up PyTorch Lightning training.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(subparsers)
    _add_bench_allreduce(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from lightning_speedkit._demo import DemoConfig, comparison_table, run_demo

        config = DemoConfig(
            steps=args.steps,
            size=args.size,
            accelerator=args.accelerator,
            devices=args.devices,
            precision=args.precision,
            batch_size=args.batch_size,
            num_workers=args.num_workers,
            data_dir=args.data_dir,
            output_dir=args.output_dir,
            seed=args.seed,
            runs=(args.only,) if args.only else ("plain", "kit"),
        )
        from speedkit_examples.vlm import DataDirectoryError

        try:
            result = run_demo(config)
        except DataDirectoryError as exc:
            print(f"speedkit demo: error: {exc}", file=sys.stderr)
            return 2
        if result is not None:  # None on ranks other than 0
            print(comparison_table(result))
    elif args.command == "bench-allreduce":
        import json

        from lightning_speedkit.distributed.allreduce_bench import (
            bench_allreduce,
            format_table,
            parse_size,
            to_json,
        )
        from lightning_speedkit.errors import SpeedkitConfigError

        try:
            sizes = [parse_size(s) for s in args.sizes]
            rows = bench_allreduce(args.backend, args.nprocs, sizes, args.iters, args.warmup)
        except SpeedkitConfigError as exc:
            print(f"speedkit bench-allreduce: error: {exc}", file=sys.stderr)
            return 2
        print(format_table(rows))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(to_json(rows), handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
