"""The kit's error for bad user input."""

from __future__ import annotations

__all__ = ["SpeedkitConfigError"]


class SpeedkitConfigError(ValueError):
    """An argument the kit cannot work with.

    The message names the argument in backticks, the value received, why it is
    wrong, and the fix.
    """
