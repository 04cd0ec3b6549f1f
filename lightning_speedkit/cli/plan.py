"""``speedkit plan``: each device's memory under DDP, ZeRO-1/2/3 and the kit's presets.

A thin parser over :func:`lightning_speedkit.distributed.plan_memory.plan_memory`: the
parameters come from ``--params`` or from a real model (``--model``, counted on the meta
device); with ``--gpu-mem`` it says which plans fit and recommends one.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from lightning_speedkit.cli._flag_values import positive_float, positive_int, real
from lightning_speedkit.cli._model_factory import EXAMPLE_MODEL, count_parameters
from lightning_speedkit.cli._parser import CommandLineError

if TYPE_CHECKING:
    from lightning_speedkit.cli._parser import Subparsers

NAME = "plan"

#: plan_memory's argument names, as this command's flags.
FLAGS = {
    "n_params": "--params", "trainable_params": "--trainable", "n_devices": "--gpus",
    "optimizer": "--optimizer", "precision": "--precision", "device": "--device",
    "batch_size": "--batch", "seq_len": "--seq", "hidden_size": "--hidden",
    "n_layers": "--layers", "n_heads": "--heads", "fused_attention": "--fused-attention",
    "device_memory": "--gpu-mem", "headroom": "--headroom",
}  # fmt: skip


def _parameter_count(text: str) -> float:
    return _whole(text, real(text, _COUNT, 1.0, open_low=False), _COUNT)


def _trainable_count(text: str) -> float:
    what = "a whole number of parameters of 0 or more, e.g. 1e9"
    return _whole(text, real(text, what, 0.0, open_low=False), what)


_COUNT = "a whole number of parameters of at least 1, e.g. 7e9"


def _whole(text: str, value: float, what: str) -> float:
    """A parameter count is whole (``7.5`` is a typo for ``7.5e9``, not a model)."""
    if value != int(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def _share(text: str) -> float:
    return real(text, "a share of device memory above 0 and at most 1, e.g. 0.9", 0.0, high=1.0)


def add_parser(subparsers: Subparsers) -> None:
    """The ``plan`` subcommand and its flags."""
    plan = subparsers.add_parser(
        NAME,
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
        f"{EXAMPLE_MODEL} is the example VLM with its default config)",
    )
    plan.add_argument(
        "--trainable", type=_trainable_count, default=None, help="trainable parameters"
    )
    plan.add_argument("--gpus", type=positive_int, required=True, help="data-parallel devices")
    plan.add_argument("--gpu-mem", type=positive_float, default=None, help="GiB per device")
    plan.add_argument("--optimizer", choices=("adam", "adamw", "sgd"), default="adam")
    plan.add_argument("--precision", choices=("mixed", "fp32"), default="mixed")
    plan.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="where the optimizer steps: torch's Adam takes every tensor at once on cuda "
        "(foreach), one at a time on cpu; it sets the step's temporaries (default: %(default)s)",
    )
    plan.add_argument("--batch", type=positive_int, default=None, help="micro-batch per device")
    plan.add_argument("--seq", type=positive_int, default=None, help="sequence length")
    plan.add_argument("--hidden", type=positive_int, default=None, help="hidden size")
    plan.add_argument("--layers", type=positive_int, default=None, help="transformer layers")
    plan.add_argument("--heads", type=positive_int, default=None, help="default: hidden / 64")
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


def run(args: argparse.Namespace) -> int:
    """Count the parameters, plan the memory, print the table and the recommendation."""
    from lightning_speedkit.distributed.plan_memory import plan_memory

    counted = None
    if args.model:
        params, trainable, note = count_parameters(args.model)
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
