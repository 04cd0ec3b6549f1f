"""The ``speedkit`` command.

Each subcommand is a thin argument parser over a function of the package; only
subcommands that exist are listed by ``speedkit --help``.

Bad input never ends in a traceback: the flags are checked as they are parsed
(numbers finite and in range, devices and precisions from their lists), output paths
before any long work, and what the kit refuses (a
:class:`~lightning_speedkit.errors.SpeedkitConfigError`) is printed as one line on
stderr, in the flags' words, with exit status 2. Anything else is a bug, and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from lightning_speedkit.__about__ import __version__

EXIT_USAGE = 2
"""Exit status of a command refused for its input (argparse's own)."""


class CommandLineError(Exception):
    """Input a subcommand cannot work with; ``main`` prints it as one line, exit status 2.

    ``prog`` is the (sub)command that refused it, where argparse knows it better.
    """

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, with its usage errors raised for ``main`` to print as one line."""

    def error(self, message: str) -> NoReturn:
        raise CommandLineError(message, prog=self.prog)


# ---------------------------------------------------------------------- flag value types


def _integer(text: str, what: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def _real(
    text: str, what: str, low: float, *, open_low: bool = True, high: float | None = None
) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    above = value > low if open_low else value >= low
    if not math.isfinite(value) or not above or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def _positive_int(text: str) -> int:
    return _integer(text, "a positive integer", 1)


def _non_negative_int(text: str) -> int:
    return _integer(text, "0 or more", 0)


def _seed(text: str) -> int:
    return _integer(text, "an integer from 0 to 4294967295 (numpy's seeds)", 0, 2**32 - 1)


def _process_count(text: str) -> int:
    return _integer(text, "at least 2 (an all-reduce needs two processes)", 2)


def _positive_float(text: str) -> float:
    return _real(text, "a positive finite number", 0.0)


def _parameter_count(text: str) -> float:
    return _real(text, "a number of parameters of at least 1, e.g. 7e9", 1.0, open_low=False)


def _trainable_count(text: str) -> float:
    return _real(text, "a number of parameters of 0 or more, e.g. 1e9", 0.0, open_low=False)


def _share(text: str) -> float:
    return _real(text, "a share of device memory above 0 and at most 1, e.g. 0.9", 0.0, high=1.0)


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


# ------------------------------------------------------------------------- output paths


def _output_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """``path``, a directory the command can create or write in: checked before the work."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise CommandLineError(
            f"argument {flag}: {str(target)!r} is a file, not a directory; give a directory"
        )
    _check_writable_under(target, target, flag)
    return target


def _output_file(path: str | os.PathLike[str], flag: str) -> Path:
    """``path``, a file the command can create or overwrite: checked before the work."""
    target = Path(path)
    if target.is_dir():
        raise CommandLineError(
            f"argument {flag}: {str(target)!r} is a directory; give a file name, e.g. "
            f"{str(target / 'results.json')!r}"
        )
    if target.exists() and not os.access(target, os.W_OK):
        raise CommandLineError(f"argument {flag}: cannot overwrite {str(target)!r}: read-only")
    _check_writable_under(target, target.parent, flag)
    return target


def _check_writable_under(target: Path, directory: Path, flag: str) -> None:
    """``directory`` (where ``target`` goes) exists and is writable, or can be created."""
    existing = directory
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise CommandLineError(
            f"argument {flag}: cannot write {str(target)!r}: {str(existing)!r} is a file, "
            "not a directory; give a path under a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CommandLineError(
            f"argument {flag}: cannot write {str(target)!r}: {str(existing)!r} is not writable "
            "(permission denied or a read-only file system); give a writable directory"
        )


def _cannot_write(flag: str, path: Path, error: OSError) -> CommandLineError:
    """An output that failed to write after the checks (disk full, a race): one line."""
    where = error.filename or path
    return CommandLineError(
        f"argument {flag}: cannot write {str(where)!r}: {error.strerror or error}"
    )


# ------------------------------------------------------------- the kit's words -> flags

# Where a subcommand passes a flag to the kit under another name, the kit's errors name
# the Python argument; the command line speaks of the flag.
_FLAGS: dict[str, dict[str, str]] = {
    "demo": {
        "steps": "--steps", "size": "--size", "accelerator": "--accelerator",
        "devices": "--devices", "precision": "--precision", "batch_size": "--batch-size",
        "micro_batch_size": "--batch-size", "global_batch": "--global-batch",
        "target_global_batch": "--global-batch", "num_workers": "--num-workers",
        "data_dir": "--data-dir", "output_dir": "--output-dir", "seed": "--seed",
    },
    "plan": {
        "n_params": "--params", "trainable_params": "--trainable", "n_devices": "--gpus",
        "optimizer": "--optimizer", "precision": "--precision", "device": "--device",
        "batch_size": "--batch", "seq_len": "--seq", "hidden_size": "--hidden",
        "n_layers": "--layers", "n_heads": "--heads", "fused_attention": "--fused-attention",
        "device_memory": "--gpu-mem", "headroom": "--headroom",
    },
    "bench-attention": {
        "seq_lens": "--seq", "head_dims": "--head-dim", "heads": "--heads",
        "kv_heads": "--kv-heads", "batch": "--batch", "backends": "--backends",
        "backend": "--backends", "dtype": "--dtype", "device": "--device",
        "repeats": "--repeats", "memory_limit_gib": "--memory-limit", "causal": "--no-causal",
    },
    "bench-allreduce": {
        "backend": "--backend", "world_size": "--nprocs", "sizes": "--sizes",
        "iters": "--iters", "warmup": "--warmup",
    },
    "report": {"unprofiled_step_ms": "--step-ms", "directory": "--out"},
}  # fmt: skip

_QUOTED_NAME = re.compile(r"`([A-Za-z_]\w*)(=[^`]*)?`")


def speak_of_flags(message: str, flags: Mapping[str, str]) -> str:
    """``message`` with the Python argument names in ``flags`` written as their flags.

    A name in backticks becomes its flag (```kv_heads=3``` -> ```--kv-heads 3```); a bare
    name with an underscore (``n_params``) too, where it stands as a word of its own.

    Example::

        >>> speak_of_flags("`world_size` must be at least 2, got 1.", {"world_size": "--nprocs"})
        '`--nprocs` must be at least 2, got 1.'
        >>> speak_of_flags("`kv_heads=3` must divide `heads=8`.",
        ...                {"kv_heads": "--kv-heads", "heads": "--heads"})
        '`--kv-heads 3` must divide `--heads 8`.'
    """

    def quoted(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        if name not in flags:
            return match.group(0)
        return f"`{flags[name]}{' ' + value[1:] if value else ''}`"

    message = _QUOTED_NAME.sub(quoted, message)
    for name, flag in flags.items():
        if "_" in name:
            message = re.sub(rf"(?<![\w./`-]){re.escape(name)}(?![\w/`-])", flag, message)
    return message


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


# --------------------------------------------------------------------------------- demo


_ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")


def _add_demo(subparsers: argparse._SubParsersAction[_ArgumentParser]) -> None:
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
        choices=_ACCELERATORS,
        default=defaults.accelerator,
        help="Lightning accelerator; gpu and cuda are the same (default: %(default)s)",
    )
    demo.add_argument(
        "--devices",
        type=_positive_int,
        default=defaults.devices,
        help="devices (processes); more than 1 trains with DDP (default: %(default)s)",
    )
    demo.add_argument(
        "--precision",
        choices=_PRECISIONS,
        default=defaults.precision,
        help="Lightning precision (default: %(default)s)",
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
        "--seed", type=_seed, default=defaults.seed, help="random seed (default: %(default)s)"
    )


def _demo(args: argparse.Namespace) -> int:
    import torch

    from lightning_speedkit._demo import runs_on_cuda

    on_cuda = runs_on_cuda(args.accelerator)
    if on_cuda and not torch.cuda.is_available():
        raise CommandLineError(
            f"argument --accelerator: {args.accelerator} needs a CUDA device and torch sees "
            "none (torch.cuda.is_available() is False); use --accelerator cpu or auto"
        )
    if on_cuda and args.devices > torch.cuda.device_count():
        raise CommandLineError(
            f"argument --devices: {args.devices} asked, {torch.cuda.device_count()} CUDA "
            "device(s) visible; ask for fewer"
        )
    if args.data_dir is not None:  # an unwritable one may still hold the corpus: checked later
        data_dir = Path(args.data_dir)
        blocker = next((p for p in (data_dir, *data_dir.parents) if p.is_file()), None)
        if blocker is not None:
            raise CommandLineError(
                f"argument --data-dir: cannot keep the example corpus in {args.data_dir!r}: "
                f"{str(blocker)!r} is a file, not a directory; give a directory"
            )
    _output_dir(args.output_dir, "--output-dir")

    from lightning_speedkit._demo import DemoConfig, comparison_table, run_demo
    from speedkit_examples.vlm import DataDirectoryError

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
    try:
        result = run_demo(config)
    except DataDirectoryError as exc:
        raise CommandLineError(speak_of_flags(str(exc), _FLAGS["demo"])) from exc
    if result is not None:  # None on ranks other than 0
        print(comparison_table(result))
    return 0


# ---------------------------------------------------------------------- bench-allreduce


_DEFAULT_SIZES = ("4KB", "64KB", "1MB", "16MB", "64MB")


def _add_bench_allreduce(subparsers: argparse._SubParsersAction[_ArgumentParser]) -> None:
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
        "--nprocs", type=_process_count, default=2, help="processes, 2 or more (default: 2)"
    )
    bench.add_argument("--sizes", nargs="+", type=_message_size, default=None,
                       help=f"message sizes (default: {' '.join(_DEFAULT_SIZES)})")  # fmt: skip
    bench.add_argument("--iters", type=_positive_int, default=20, help="timed calls per size")
    bench.add_argument("--warmup", type=_non_negative_int, default=5, help="untimed calls per size")
    bench.add_argument("--json", default=None, help="also write the rows to this JSON file")


def _bench_allreduce(args: argparse.Namespace) -> int:
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
    out = _output_file(args.json, "--json") if args.json else None
    sizes = args.sizes or [parse_size(s) for s in _DEFAULT_SIZES]
    rows = bench_allreduce(args.backend, args.nprocs, sizes, args.iters, args.warmup)
    print(format_table(rows))
    if out is not None:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(to_json(rows), indent=2))
        except OSError as exc:
            raise _cannot_write("--json", out, exc) from exc
    return 0


# ---------------------------------------------------------------------- bench-attention


def _add_bench_attention(subparsers: argparse._SubParsersAction[_ArgumentParser]) -> None:
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
        help="key/value heads, each dividing --heads; fewer than --heads is GQA "
        "(default: %(default)s)",
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
    bench.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="default: cuda if available, else cpu",
    )
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=5,
        help="timed repeats per shape, median kept (default: %(default)s)",
    )
    bench.add_argument(
        "--memory-limit",
        type=_positive_float,
        default=8.0,
        help="skip shapes whose eager scores need more GiB (default: %(default)s)",
    )
    bench.add_argument("--out", default="bench_attention",
                       help="directory for results.json and the plot")  # fmt: skip


def _bench_attention(args: argparse.Namespace) -> int:
    import platform
    from datetime import datetime, timezone

    import torch

    from lightning_speedkit import _imports
    from lightning_speedkit.attention.bench import bench_attention, format_table, plot, write_json

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
    out = _output_dir(args.out, "--out")
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
    device = rows[0].device
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "causal": not args.no_causal,
    }
    try:
        write_json(rows, out / "results.json", meta)
        print(f"\nwrote {out / 'results.json'}")
        if _imports.MATPLOTLIB_AVAILABLE:
            print(f"wrote {plot(rows, out / 'attention.png')}")
        else:
            print("no plot: pip install 'lightning_speedkit[plot]' for one")
    except OSError as exc:
        raise _cannot_write("--out", out, exc) from exc
    return 0


# --------------------------------------------------------------------------------- plan


_EXAMPLE_MODEL = "speedkit_examples.vlm:VLM"


def _add_plan(subparsers: argparse._SubParsersAction[_ArgumentParser]) -> None:
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
    what.add_argument("--params", type=_parameter_count, help="parameters, e.g. 7e9")
    what.add_argument(
        "--model",
        metavar="MODULE:FACTORY",
        help="count a real model's parameters (trainable and frozen apart) on the meta "
        "device: FACTORY builds it with no arguments (a function, or a model class; "
        f"{_EXAMPLE_MODEL} is the example VLM with its default config)",
    )
    plan.add_argument(
        "--trainable", type=_trainable_count, default=None, help="trainable parameters"
    )
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
        "--gradient-as-bucket-view",
        action="store_true",
        help="DDP's gradients as views into its buckets, as the kit's DDP strategies set it "
        "(no second copy of the gradients in DDP's rows)",
    )
    plan.add_argument(
        "--headroom",
        type=_share,
        default=0.9,
        help="share of device memory a plan may use, at most 1 (default: %(default)s)",
    )


def _model_builder(spec: str) -> tuple[Callable[[], Any], str]:
    """What ``--model MODULE:FACTORY`` names, as a function of no arguments, and a note.

    The module is imported as ``python -m`` would (the current directory first). The
    example VLM's class is built with its default config (the ``tiny`` preset).
    """
    import importlib
    import inspect

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CommandLineError(
            f"argument --model: expected MODULE:FACTORY, e.g. {_EXAMPLE_MODEL}, got {spec!r}"
        )
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise CommandLineError(
            f"argument --model: cannot import {module_name!r} (from {spec!r}): {err}"
        ) from err
    except Exception as err:  # the user's module failed as it ran: their code, not ours
        raise CommandLineError(
            f"argument --model: importing {module_name!r} (from {spec!r}) raised "
            f"{type(err).__name__}: {err}; fix the module so that it imports, or give "
            "--params instead"
        ) from err
    finally:
        if added:
            sys.path.remove(os.getcwd())
    build: Any = module
    for part in attr.split("."):
        build = getattr(build, part, None)
    if not callable(build):
        raise CommandLineError(
            f"argument --model: {module_name} has no function or class {attr!r} (from {spec!r})"
        )
    if getattr(build, "__module__", "").startswith("speedkit_examples.vlm"):
        from speedkit_examples.vlm import VLM, CaptionTokenizer, VLMConfig

        if build is VLM:
            vocab = CaptionTokenizer().vocab_size
            return (lambda: VLM(VLMConfig(vocab_size=vocab))), " (VLMConfig's defaults)"
    try:
        signature = inspect.signature(build)
    except ValueError:  # no signature to read (a builtin): calling it will tell
        return build, ""
    required = [
        name
        for name, p in signature.parameters.items()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        raise CommandLineError(
            f"argument --model: {spec} needs arguments ({', '.join(required)}); name a "
            "function that builds the model without any, e.g. `def build(): return "
            "MyModel(MyConfig())`, as --model MODULE:build"
        )
    return build, ""


def _count_parameters(spec: str) -> tuple[int, int, str]:
    """``(all, trainable, note)`` of ``--model``'s model, built on the meta device."""
    import torch

    build, note = _model_builder(spec)
    try:
        with torch.device("meta"):  # no memory: a 70B model counts in a second
            model = build()
    except Exception as err:  # the user's factory failed: their code, not ours
        raise CommandLineError(
            f"argument --model: {spec} raised {type(err).__name__}: {err} (called with no "
            "arguments, on the meta device); fix the factory so that it builds the model, "
            "or give --params instead"
        ) from err
    if not isinstance(model, torch.nn.Module):
        raise CommandLineError(
            f"argument --model: {spec} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    seen = {id(p): p for p in model.parameters()}  # tied parameters once
    return (sum(p.numel() for p in seen.values()),
            sum(p.numel() for p in seen.values() if p.requires_grad), note)  # fmt: skip


def _plan(args: argparse.Namespace) -> int:
    from lightning_speedkit.distributed.plan_memory import plan_memory

    counted = None
    if args.model:
        params, trainable, note = _count_parameters(args.model)
        counted = f"{args.model}{note}: {params:,} parameters, {trainable:,} trainable"
        total = f"the model's {params:,}"
    else:
        params, trainable = args.params, args.trainable
        total = f"--params {args.params:,.0f}"
    if args.trainable is not None:
        if args.trainable > params:
            raise CommandLineError(
                f"argument --trainable: {args.trainable:,.0f} is more than {total} parameters; "
                "give at most that many"
            )
        trainable = int(args.trainable)
    shape = {"--batch": args.batch, "--seq": args.seq, "--hidden": args.hidden,
             "--layers": args.layers}  # fmt: skip
    if args.heads is not None and all(v is None for v in shape.values()):
        raise CommandLineError(
            "argument --heads: it shapes the activations, which need --batch, --seq, --hidden "
            "and --layers too; give them, or leave --heads out"
        )
    plan = plan_memory(
        params, args.gpus, trainable_params=trainable, optimizer=args.optimizer,
        precision=args.precision, batch_size=args.batch, seq_len=args.seq,
        hidden_size=args.hidden, n_layers=args.layers, n_heads=args.heads,
        fused_attention=args.fused_attention, device=args.device,
        gradient_as_bucket_view=args.gradient_as_bucket_view,
    )  # fmt: skip
    if counted is not None:
        print(counted)
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


# ------------------------------------------------------------------------------- report


def _add_report(subparsers: argparse._SubParsersAction[_ArgumentParser]) -> None:
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

    from lightning_speedkit.measure.report import analyze_trace

    trace = Path(args.trace)
    out = Path(args.out) if args.out else trace.parent
    flag = "--out" if args.out else "--out (default: the trace's directory)"
    if args.out or trace.is_file():  # a missing trace: analyze_trace says so first
        _output_dir(out, flag)
    report = analyze_trace(trace, unprofiled_step_ms=args.step_ms)
    name = trace.name.split(".")[0]
    try:
        files = report.write(out, f"{name}.report")
    except OSError as exc:
        raise _cannot_write(flag, out, exc) from exc
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_markdown())
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------- main


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": _demo,
    "bench-allreduce": _bench_allreduce,
    "bench-attention": _bench_attention,
    "plan": _plan,
    "report": _report,
}


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
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
    """Run ``speedkit``; the exit status: 0, or 2 for input it refused (one line on stderr).

    ``--help`` and ``--version`` exit through ``SystemExit(0)``, as argparse does.
    """
    from lightning_speedkit.errors import SpeedkitConfigError

    prog = "speedkit"
    try:
        args = build_parser().parse_args(argv)
        prog = f"speedkit {args.command}"
        return _COMMANDS[args.command](args)
    except CommandLineError as exc:
        message = f"{exc.prog or prog}: error: {exc}"
    except SpeedkitConfigError as exc:  # the kit refused what it was given
        flags = _FLAGS.get(prog.removeprefix("speedkit "), {})
        message = f"{prog}: error: {speak_of_flags(str(exc), flags)}"
    print(_one_line(message), file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
