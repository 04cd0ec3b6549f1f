"""Flag values checked as they are parsed: numbers finite and in range, in the flag's words.

The range checks are the kit's own (:mod:`lightning_speedkit._validation`); what they
refuse is said as argparse says it, after the flag: ``argument --steps: must be a positive
integer, got 0``. The kit's message speaks of a Python argument (``pass e.g. `steps=1```),
which is not what the command line takes, so the flag's own words replace it.
"""

from __future__ import annotations

import argparse

from lightning_speedkit import _validation
from lightning_speedkit.errors import SpeedkitConfigError


def integer(text: str, what: str, low: int, high: int | None = None) -> int:
    """``text`` as an integer from ``low`` to ``high``; ``what`` says what the flag takes.

    Example::

        >>> integer("3", "a positive integer", 1)
        3
        >>> integer("0", "a positive integer", 1)
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be a positive integer, got 0
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    try:
        return _validation.integer("value", value, at_least=low, at_most=high)
    except SpeedkitConfigError:  # in the flag's words: see the module's docstring
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}") from None


def real(
    text: str, what: str, low: float, *, open_low: bool = True, high: float | None = None
) -> float:
    """``text`` as a finite number above ``low`` (or at it, unless ``open_low``), at most ``high``.

    Example::

        >>> real("0.5", "a positive finite number", 0.0)
        0.5
        >>> real("inf", "a positive finite number", 0.0)
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be a positive finite number, got inf
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    try:
        return _validation.number("value", value, low=low, low_open=open_low, high=high)
    except SpeedkitConfigError:  # in the flag's words: see the module's docstring
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}") from None


def positive_int(text: str) -> int:
    """A count of at least 1 (steps, devices, batch sizes, repeats)."""
    return integer(text, "a positive integer", 1)


def non_negative_int(text: str) -> int:
    """A count of 0 or more (workers, warm-up calls)."""
    return integer(text, "0 or more", 0)


def positive_float(text: str) -> float:
    """A finite number above 0 (milliseconds, GiB)."""
    return real(text, "a positive finite number", 0.0)
