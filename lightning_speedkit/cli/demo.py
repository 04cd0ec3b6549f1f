"""``speedkit demo``: the example VLM trained twice, plain Lightning vs the kit, compared.

A thin parser over :func:`lightning_speedkit._demo.run_demo`: the devices, the corpus
directory and the output directory are checked before any training starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_speedkit.cli._flag_names import speak_of_flags
from lightning_speedkit.cli._flag_values import integer, non_negative_int, positive_int
from lightning_speedkit.cli._output_paths import output_dir
from lightning_speedkit.cli._parser import CommandLineError

if TYPE_CHECKING:
    from lightning_speedkit._demo import DemoConfig
    from lightning_speedkit.cli._parser import Subparsers

NAME = "demo"

#: The kit's argument names (DemoConfig's, the corpus's), as this command's flags.
FLAGS = {
    "steps": "--steps", "size": "--size", "accelerator": "--accelerator",
    "devices": "--devices", "precision": "--precision", "batch_size": "--batch-size",
    "micro_batch_size": "--batch-size", "global_batch": "--global-batch",
    "target_global_batch": "--global-batch", "num_workers": "--num-workers",
    "data_dir": "--data-dir", "output_dir": "--output-dir", "seed": "--seed",
}  # fmt: skip

_ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")


def _seed(text: str) -> int:
    return integer(text, "an integer from 0 to 4294967295 (numpy's seeds)", 0, 2**32 - 1)


def add_parser(subparsers: Subparsers) -> None:
    """The ``demo`` subcommand and its flags, their defaults DemoConfig's."""
    from lightning_speedkit._demo import DemoConfig

    defaults = DemoConfig()
    demo = subparsers.add_parser(
        NAME,
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
    _add_training_flags(demo, defaults)
    _add_run_flags(demo, defaults)


def _add_training_flags(demo: argparse.ArgumentParser, defaults: DemoConfig) -> None:
    """What both runs train: steps, model, devices, precision, batches, loader workers."""
    demo.add_argument(
        "--steps",
        type=positive_int,
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
        type=positive_int,
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
        type=positive_int,
        default=defaults.batch_size,
        help="samples per batch per device (default: %(default)s)",
    )
    demo.add_argument(
        "--num-workers",
        type=non_negative_int,
        default=defaults.num_workers,
        help="DataLoader workers of the plain run (default: %(default)s)",
    )
    demo.add_argument(
        "--freeze-vision",
        action="store_true",
        help=(
            "train both runs with the vision tower frozen; the kit adds FrozenFeatureCache, "
            "and the plain run says what share of its step the tower took"
        ),
    )
    demo.add_argument(
        "--global-batch",
        type=positive_int,
        default=None,
        help=(
            "samples per optimizer step over all devices: the plain run reaches it with "
            "Trainer(accumulate_grad_batches), the kit with AccumulationScheduler "
            "(default: one batch per step)"
        ),
    )


def _add_run_flags(demo: argparse.ArgumentParser, defaults: DemoConfig) -> None:
    """Which runs, where the corpus and the results go, the seed."""
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


def _check_devices(args: argparse.Namespace) -> None:
    """Refuse CUDA runs that this machine's torch cannot give: no device, or too few."""
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


def run(args: argparse.Namespace) -> int:
    """Check the devices and directories, train both runs, print their comparison."""
    _check_devices(args)
    if args.data_dir is not None:  # an unwritable one may still hold the corpus: checked later
        data_dir = Path(args.data_dir)
        blocker = next((p for p in (data_dir, *data_dir.parents) if p.is_file()), None)
        if blocker is not None:
            raise CommandLineError(
                f"argument --data-dir: cannot keep the example corpus in {args.data_dir!r}: "
                f"{str(blocker)!r} is a file, not a directory; give a directory"
            )
    output_dir(args.output_dir, "--output-dir")

    from lightning_speedkit._demo import run_demo
    from lightning_speedkit._demo_results import DemoConfig, comparison_table
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
        freeze_vision=args.freeze_vision,
    )
    try:
        result = run_demo(config)
    except DataDirectoryError as exc:
        raise CommandLineError(speak_of_flags(str(exc), FLAGS)) from exc
    if result is not None:  # None on ranks other than 0
        print(comparison_table(result))
    return 0
