"""How ``speedkit`` refuses input: one line, ``speedkit <cmd>: error: ...``, exit status 2.

Every refusal of a subcommand, argparse's own included, is a :class:`CommandLineError`;
``main`` prints it as one line on stderr, after the (sub)command's name, as argparse
prints its usage errors, and returns :data:`EXIT_USAGE`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING, NoReturn, Protocol

EXIT_USAGE = 2
"""Exit status of a command refused for its input (argparse's own)."""


class CommandLineError(Exception):
    """Input a subcommand cannot work with; ``main`` prints it as one line, exit status 2.

    ``prog`` is the (sub)command that refused it, where argparse knows it better.
    """

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with its usage errors raised for ``main`` to print as one line."""

    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):  # argparse reads `-7e9` as a flag
            message += " (a value that starts with '-' goes after '=': `--params=-7e9`)"
        raise CommandLineError(message, prog=self.prog)


if TYPE_CHECKING:  # what each subcommand's ``add_parser`` adds its parser to
    Subparsers = argparse._SubParsersAction[ArgumentParser]


class Subcommand(Protocol):
    """What each subcommand's module holds: its name, its flags, its parser, its run."""

    @property
    def NAME(self) -> str:  # noqa: N802 (a module constant)
        """The subcommand, as typed after ``speedkit``."""

    @property
    def FLAGS(self) -> Mapping[str, str]:  # noqa: N802 (a module constant)
        """The kit's argument names (in its errors) -> this subcommand's flags."""

    def add_parser(self, subparsers: Subparsers) -> None:
        """Add the subcommand's parser and flags."""

    def run(self, args: argparse.Namespace) -> int:
        """Do the work; the exit status (0), or raise what ``main`` prints as one line."""


def one_line(message: str) -> str:
    """``message`` on one line: its lines stripped and joined by spaces, blank ones dropped.

    Example::

        >>> one_line("speedkit plan: error: `--gpus` must be\\n  at least 1.\\n")
        'speedkit plan: error: `--gpus` must be at least 1.'
    """
    return " ".join(line.strip() for line in message.splitlines() if line.strip())
