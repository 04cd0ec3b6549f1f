"""Timestamps taken in per-step hooks without waiting for the device; read only when due.

On CPU the host is the device: a timestamp is the host clock. On CUDA it is an event
recorded on the current stream, which the host does not wait for; turning events into
seconds waits for the last of them once, when a figure is due (a log interval, an
accumulation decision). SpeedMonitor times steps and data waits with :class:`StepClock`;
AccumulationScheduler times its accumulation windows with :class:`Stamps`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def _host_time() -> float:
    """The host clock (seconds); tests replace it with a virtual one."""
    return time.perf_counter()


class Stamps:
    """Timestamps on one device: host seconds on CPU, CUDA events on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> Any:
        if not self.cuda:
            return _host_time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # enqueued on the current stream; the host does not wait
        return event

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end``; on CUDA, only after :meth:`wait` on a later stamp."""
        return float(start.elapsed_time(end)) / 1e3 if self.cuda else float(end - start)

    def wait(self, stamp: Any) -> None:
        """Wait until the device has reached ``stamp`` (nothing to wait for on CPU)."""
        if self.cuda:
            stamp.synchronize()  # SYNC: once per figure due, to read the events


class StepClock:
    """Step times and data waits of training batches, read once per log interval.

    The step time runs from the end of one batch to the end of the next; the data wait
    is the gap between one batch's end and the next one's start (on CUDA, the device's
    idle gap). The first batch after :meth:`gap` has no previous end, so no step time.

    A step's compute runs from its batch's start to its first backward
    (:meth:`backward_start`): under DDP the backward's all-reduce waits for the slowest
    rank, so every rank's step time is the slowest's, and only the compute before it
    tells the ranks apart. A step with no backward seen counts its whole time.

    ``untimed()`` (read at each batch's start and end: a Python call, no sync) says that
    the step under way does not run at training's pace (a ProfilerSchedule window's
    profiled steps); such a step is not timed, nor is the next, whose wait would hold
    what ran after it (the window's trace written and analysed).
    """

    def __init__(self, device: torch.device, untimed: Callable[[], bool] = lambda: False) -> None:
        self.stamps = Stamps(device)
        self._untimed = untimed
        self._pending: list[tuple[Any, Any, Any, Any]] = []  # (previous end, start, backward, end)
        self._last_end: Any = None
        self._start: Any = None
        self._backward: Any = None
        self._untimed_at_start = False

    def gap(self) -> None:
        """Forget the previous batch end: the next gap (validation, new epoch) is not data wait."""
        self._last_end = None

    def batch_start(self) -> None:
        self._untimed_at_start = self._untimed()
        self._start, self._backward = self.stamps.now(), None

    def backward_start(self) -> None:
        """The step's first backward starts: its compute before the gradients' sync ends."""
        if self._backward is None:
            self._backward = self.stamps.now()

    def batch_end(self, keep: bool) -> bool:
        """Time the step that ends here if ``keep`` (and it ran at training's pace); whether
        it was timed."""
        end = self.stamps.now()
        untimed = self._untimed_at_start or self._untimed()  # either hook order
        timed = keep and not untimed and self._last_end is not None
        if timed:
            self._pending.append((self._last_end, self._start, self._backward or end, end))
        self._last_end = None if untimed else end
        return timed

    def drain(self) -> tuple[list[float], list[float], list[float]]:
        """The step times, data waits and computes (seconds) timed since the last drain."""
        pending, self._pending = self._pending, []
        if not pending:
            return [], [], []
        seconds = self.stamps.seconds
        self.stamps.wait(pending[-1][3])
        steps = [seconds(previous, end) for previous, _, _, end in pending]
        waits = [max(0.0, seconds(previous, start)) for previous, start, _, _ in pending]
        computes = [seconds(start, backward) for _, start, backward, _ in pending]
        return steps, waits, computes
