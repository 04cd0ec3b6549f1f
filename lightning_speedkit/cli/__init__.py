"""The ``speedkit`` command.

Each subcommand is a thin argument parser over a function of the package, in a module of
its own (``add_parser`` and ``run``); only subcommands that exist are listed by
``speedkit --help``.

Bad input never ends in a traceback: the flags are checked as they are parsed
(numbers finite and in range, devices and precisions from their lists), output paths
before any long work, and what the kit refuses (a
:class:`~lightning_speedkit.errors.SpeedkitConfigError`) is printed as one line on
stderr, in the flags' words, with exit status 2. Anything else is a bug, and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_speedkit.__about__ import __version__
from lightning_speedkit.cli import bench_allreduce, bench_attention, demo, plan, report
from lightning_speedkit.cli._flag_names import speak_of_flags
from lightning_speedkit.cli._parser import (
    EXIT_USAGE,
    ArgumentParser,
    CommandLineError,
    Subcommand,
    one_line,
)

__all__ = ["EXIT_USAGE", "CommandLineError", "build_parser", "main", "speak_of_flags"]

# In the order ``speedkit --help`` lists them.
_SUBCOMMANDS: tuple[Subcommand, ...] = (demo, bench_allreduce, bench_attention, plan, report)
_COMMANDS: dict[str, Subcommand] = {command.NAME: command for command in _SUBCOMMANDS}


def build_parser() -> argparse.ArgumentParser:
    """``speedkit``'s parser: ``--version`` and one subparser per subcommand.

    Example::

        >>> build_parser().parse_args(["plan", "--params", "7e9", "--gpus", "8"]).gpus
        8
    """
    parser = ArgumentParser(
        prog="speedkit",
        description="lightning_speedkit: measure and speed up PyTorch Lightning training.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in _SUBCOMMANDS:
        command.add_parser(subparsers)
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
        return _COMMANDS[args.command].run(args)
    except CommandLineError as exc:  # unknown flags are found by the top parser: name the command
        named = next((a for a in argv or sys.argv[1:] if not a.startswith("-")), None)
        if exc.prog == "speedkit" and named in _COMMANDS:
            exc.prog = f"speedkit {named}"
        message = f"{exc.prog or prog}: error: {exc}"
    except SpeedkitConfigError as exc:  # the kit refused what it was given
        command = _COMMANDS.get(prog.removeprefix("speedkit "))
        flags = command.FLAGS if command is not None else {}
        message = f"{prog}: error: {speak_of_flags(str(exc), flags)}"
    print(one_line(message), file=sys.stderr)
    return EXIT_USAGE
