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
            "plain Lightning, then with the kit (NumWorkersTuner, a SampleCache of decoded "
            "samples, AttentionSwap on CPU, a ProfilerSchedule window with its report; "
            "ddp_powersgd on several devices), "
            "both measured by "
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
    demo.add_argument(
        "--global-batch",
        type=_positive_int,
        default=None,
        help=(
            "samples per optimizer step over all devices: the plain run reaches it with "
            "Trainer(accumulate_grad_batches), the kit with AccumulationScheduler "
            "(default: one batch per step)"
        ),
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


def _add_bench_attention(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from lightning_speedkit.attention.backends import BACKENDS

    bench = subparsers.add_parser(
        "bench-attention",
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
        type=_positive_int,
        nargs="+",
        default=None,
        help="sequence lengths (default: 256-8192 on CUDA, 256-2048 on CPU)",
    )
    bench.add_argument(
        "--head-dim",
        type=_positive_int,
        nargs="+",
        default=[64],
        help="head dimensions (default: %(default)s)",
    )
    bench.add_argument("--heads", type=_positive_int, default=8, help="query heads (default: 8)")
    bench.add_argument(
        "--kv-heads",
        type=_positive_int,
        nargs="+",
        default=[8, 2],
        help="key/value heads; fewer than --heads is GQA (default: %(default)s)",
    )
    bench.add_argument("--batch", type=_positive_int, default=1, help="batch size (default: 1)")
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
    bench.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=5,
        help="timed repeats per shape, median kept (default: %(default)s)",
    )
    bench.add_argument(
        "--memory-limit",
        type=float,
        default=8.0,
        help="skip shapes whose eager scores need more GiB (default: %(default)s)",
    )
    bench.add_argument("--out", default="bench_attention",
                       help="directory for results.json and the plot")  # fmt: skip


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _add_plan(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan = subparsers.add_parser(
        "plan",
        help="per-GPU memory of DDP, ZeRO-1/2/3 and the ZeRO-2 presets; which fit",
        description=(
            "Estimate each device's memory for weights, gradients, optimizer state and "
            "(given the model's shape) activations under DDP, ZeRO-1/2/3 and the kit's "
            "presets, with and without activation checkpointing; say which fit and "
            "recommend one."
        ),
    )
    what = plan.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_positive_float, help="parameters, e.g. 7e9")
    what.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="count a real model's parameters (trainable and frozen apart) on the meta device",
    )
    plan.add_argument("--trainable", type=float, default=None, help="trainable parameters")
    plan.add_argument("--gpus", type=_positive_int, required=True, help="data-parallel devices")
    plan.add_argument("--gpu-mem", type=_positive_float, default=None, help="GiB per device")
    plan.add_argument("--optimizer", choices=("adam", "adamw", "sgd"), default="adam")
    plan.add_argument("--precision", choices=("mixed", "fp32"), default="mixed")
    plan.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="where the optimizer steps: torch's Adam takes every tensor at once on cuda "
        "(foreach), one at a time on cpu; it sets the step's temporaries (default: %(default)s)",
    )
    plan.add_argument("--batch", type=_positive_int, default=None, help="micro-batch per device")
    plan.add_argument("--seq", type=_positive_int, default=None, help="sequence length")
    plan.add_argument("--hidden", type=_positive_int, default=None, help="hidden size")
    plan.add_argument("--layers", type=_positive_int, default=None, help="transformer layers")
    plan.add_argument("--heads", type=_positive_int, default=None, help="default: hidden / 64")
    plan.add_argument(
        "--fused-attention", action="store_true", help="flash/SDPA attention (no s^2 matrices)"
    )
    plan.add_argument(
        "--headroom",
        type=_positive_float,
        default=0.9,
        help="share of device memory a plan may use (default: %(default)s)",
    )


def _plan(args: argparse.Namespace) -> int:
    from lightning_speedkit.distributed.plan_memory import count_parameters, plan_memory
    from lightning_speedkit.errors import SpeedkitConfigError

    try:
        if args.model:
            params, trainable = count_parameters(args.model)
            if args.trainable is not None:
                trainable = int(args.trainable)
            print(f"{args.model}: {params:,} parameters, {trainable:,} trainable")
        else:
            params, trainable = args.params, args.trainable
        plan = plan_memory(
            params, args.gpus, trainable_params=trainable, optimizer=args.optimizer,
            precision=args.precision, batch_size=args.batch, seq_len=args.seq,
            hidden_size=args.hidden, n_layers=args.layers, n_heads=args.heads,
            fused_attention=args.fused_attention, device=args.device,
        )  # fmt: skip
    except SpeedkitConfigError as exc:
        print(f"speedkit plan: error: {exc}", file=sys.stderr)
        return 2
    memory = args.gpu_mem * 2**30 if args.gpu_mem else None
    print(plan.table(memory, args.headroom))
    if memory is None:
        return 0
    choice = plan.recommend(memory, args.headroom)
    if choice is None:
        print(f"\nnothing fits in {args.gpu_mem:g} GiB x {args.headroom:g}: add devices, "
              f"shorten sequences or micro-batches, or shard further (ZeRO-3).")  # fmt: skip
        return 0
    name, checkpointing = choice
    strategy = name if name in ("fsdp_zero2", "deepspeed_zero2", "deepspeed_zero2_offload") else {
        "ddp": "ddp", "zero1": "deepspeed_stage_1", "zero3": "fsdp"}.get(name, name)  # fmt: skip
    extra = " with callbacks=[ActivationCheckpointing()]" if checkpointing else ""
    print(f"\nrecommended: Trainer(strategy={strategy!r}){extra}")
    return 0


def _add_report(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    report = subparsers.add_parser(
        "report",
        help="diagnose a profiler trace: where the step's time goes and the fix",
        description=(
            "Analyse a chrome trace of training steps (from ProfilerSchedule, Lightning's "
            "PyTorchProfiler or torch.profiler; .json or .json.gz): the step-time breakdown, "
            "module shares, host-device sync call sites, and findings with the fix the kit "
            "offers. Prints the report and writes it as markdown, JSON and PNG."
        ),
    )
    report.add_argument("trace", help="the trace file")
    report.add_argument(
        "--out",
        default=None,
        help="directory for speedkit_report.{md,json,png} (default: beside the trace)",
    )
    report.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    report.add_argument(
        "--step-ms",
        type=_positive_float,
        default=None,
        help=(
            "median step time without the profiler (e.g. SpeedMonitor's step_ms_p50): on a "
            "GPU trace, the device idle the profiler's host slowdown added is taken out"
        ),
    )


def _report(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from lightning_speedkit.errors import SpeedkitConfigError
    from lightning_speedkit.measure.report import analyze_trace

    trace = Path(args.trace)
    try:
        report = analyze_trace(trace, unprofiled_step_ms=args.step_ms)
    except SpeedkitConfigError as exc:
        print(f"speedkit report: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else trace.parent
    name = trace.name.split(".")[0]
    files = report.write(out, f"{name}.report")
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_markdown())
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="speedkit",
        description="lightning_speedkit: measure and speed up PyTorch Lightning training.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(subparsers)
    _add_bench_allreduce(subparsers)
    _add_bench_attention(subparsers)
    _add_plan(subparsers)
    _add_report(subparsers)
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
            global_batch=args.global_batch,
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
    elif args.command == "bench-attention":
        return _bench_attention(args)
    elif args.command == "plan":
        return _plan(args)
    elif args.command == "report":
        return _report(args)
    return 0


def _bench_attention(args: argparse.Namespace) -> int:
    import platform
    from datetime import datetime, timezone
    from pathlib import Path

    import torch

    from lightning_speedkit import _imports
    from lightning_speedkit.attention.bench import bench_attention, format_table, plot, write_json
    from lightning_speedkit.errors import SpeedkitConfigError

    try:
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
    except SpeedkitConfigError as exc:
        print(f"speedkit bench-attention: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    out = Path(args.out)
    device = rows[0].device
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "causal": not args.no_causal,
    }
    write_json(rows, out / "results.json", meta)
    print(f"\nwrote {out / 'results.json'}")
    if _imports.MATPLOTLIB_AVAILABLE:
        print(f"wrote {plot(rows, out / 'attention.png')}")
    else:
        print("no plot: pip install 'lightning_speedkit[plot]' for one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
