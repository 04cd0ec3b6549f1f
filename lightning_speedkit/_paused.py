"""Training paused on purpose by one of the kit's callbacks, said to those that watch steps.

NumWorkersTuner's search for spare cores stops training for up to its time budget, every
rank waiting for rank 0's answer: to HangWatchdog that looks like a hang. A callback that
pauses wraps the pause in :func:`paused`; a callback that watches steps has a
``speedkit_pause(paused: bool)`` method and stands aside in between. Neither imports the
other.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["paused"]


@contextmanager
def paused(trainer: Any) -> Iterator[None]:
    """Tell the ``trainer``'s callbacks that watch steps that training pauses for the block.

    Example::

        >>> from types import SimpleNamespace
        >>> class Watch:
        ...     def speedkit_pause(self, paused: bool) -> None:
        ...         print("paused" if paused else "resumed")
        >>> with paused(SimpleNamespace(callbacks=[Watch(), object()])):
        ...     print("searching")
        paused
        searching
        resumed
    """
    callbacks = getattr(trainer, "callbacks", [])
    watchers = [cb for cb in callbacks if callable(getattr(cb, "speedkit_pause", None))]
    for watcher in watchers:
        watcher.speedkit_pause(True)
    try:
        yield
    finally:
        for watcher in watchers:
            watcher.speedkit_pause(False)
