"""``speedkit report``: a profiler trace diagnosed, where the step's time goes and the fix.

A thin parser over :func:`lightning_speedkit.measure.report.analyze_trace`: ``--out`` (or
the trace's directory) is checked before the trace is read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_speedkit.cli._flag_values import positive_float
from lightning_speedkit.cli._output_paths import cannot_write, output_dir

if TYPE_CHECKING:
    from lightning_speedkit.cli._parser import Subparsers

NAME = "report"

#: analyze_trace's and Report.write's argument names, as this command's flags.
FLAGS = {"unprofiled_step_ms": "--step-ms", "directory": "--out"}

#: Trace file endings taken off to name the report, longest first.
_TRACE_SUFFIXES = (".pt.trace.json.gz", ".pt.trace.json", ".trace.json.gz", ".trace.json",
                  ".json.gz", ".json", ".gz")  # fmt: skip


def _report_name(trace: Path) -> str:
    """The report's file name stem: the trace's name less a known trace ending.

    Only the ending goes: Lightning's PyTorchProfiler names its traces
    ``fit-[Strategy]SingleDeviceStrategy.validation_step.<timestamp>.pt.trace.json``, so
    the name up to its first dot would be the same for all of them.

    Example::

        >>> _report_name(Path("rank0-window0.pt.trace.json.gz"))
        'rank0-window0.report'
        >>> _report_name(Path("fit-[Strategy]DDPStrategy.training_step.1714.pt.trace.json"))
        'fit-[Strategy]DDPStrategy.training_step.1714.report'
    """
    name = trace.name
    for suffix in _TRACE_SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix):
            return f"{name.removesuffix(suffix)}.report"
    return f"{name}.report"


def add_parser(subparsers: Subparsers) -> None:
    """The ``report`` subcommand and its flags."""
    report = subparsers.add_parser(
        NAME,
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
        help=(
            "directory for <trace name>.report.{md,json,png}, the trace's file name less "
            "its .pt.trace.json, .json or .gz ending (default: beside the trace)"
        ),
    )
    report.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    report.add_argument(
        "--step-ms",
        type=positive_float,
        default=None,
        help=(
            "median step time without the profiler (e.g. SpeedMonitor's step_ms_p50): on a "
            "GPU trace, the device idle the profiler's host slowdown added is taken out"
        ),
    )


def run(args: argparse.Namespace) -> int:
    """Check the output directory, analyse the trace, print the report, write its files."""
    import json

    from lightning_speedkit.measure.report import analyze_trace

    trace = Path(args.trace)
    out = Path(args.out) if args.out else trace.parent
    flag = "--out" if args.out else "--out (default: the trace's directory)"
    if args.out or trace.is_file():  # a missing trace: analyze_trace says so first
        output_dir(out, flag)
    report = analyze_trace(trace, unprofiled_step_ms=args.step_ms)
    try:
        files = report.write(out, _report_name(trace))
    except OSError as exc:
        raise cannot_write(flag, out, exc) from exc
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_markdown())
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0
