"""The kit's error for bad user input."""

from __future__ import annotations

__all__ = ["SpeedkitConfigError"]


class SpeedkitConfigError(ValueError):
    """An argument the kit cannot work with.

    Raised as early as the input can be judged (at construction or call, not in
    ``fit``), with a one-line message: the argument in backticks, the value
    received, why it is wrong, and the fix. A ``ValueError``, so code that catches
    those keeps working.

    Example::

        >>> from lightning_speedkit import ProfilerSchedule
        >>> ProfilerSchedule(max_trace_mb="10")
        Traceback (most recent call last):
        ...
        lightning_speedkit.errors.SpeedkitConfigError: `max_trace_mb` must be a positive number, got '10' (a string); pass a number, e.g. 10, not the string '10'.
    """  # noqa: E501
