"""Timing accumulation windows for the adaptive policy: compute, exposed communication, optimizer.

An accumulation window of N micro-batches under DDP runs N-1 of them under ``no_sync``
(forward and backward only) and the last one synchronising (its backward waits for
the gradient all-reduce that it did not hide), then the optimizer step. Stamping each
micro-batch's start and end, the synchronising micro-batch's end (before the optimizer
step) and the window's end gives :class:`~lightning_speedkit.schedule.policies.CommShare`:
medians over several windows of the step, one unsynchronised micro-batch, the exposed
communication (synchronising micro-batch minus an unsynchronised one) and the optimizer.

Trainer-free: the stamps come from a clock passed in (:class:`Stamps`, or any object
with ``now``, ``seconds`` and ``wait``), so tests give exact times.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from lightning_speedkit.schedule.policies import CommShare

#: Optimizer steps left out of a measurement after fit starts (start-up, allocator warm-up).
WARMUP_WINDOWS = 2


class Clock(Protocol):
    """Timestamps, as :class:`~lightning_speedkit.measure._clock.Stamps` takes them."""

    def now(self) -> Any: ...

    def seconds(self, start: Any, end: Any) -> float: ...

    def wait(self, stamp: Any) -> None: ...


@dataclass
class Window:
    """Timestamps of one accumulation window (host seconds, or CUDA events)."""

    accumulation: int
    previous_end: Any
    unsynced: list[tuple[Any, Any]] = field(default_factory=list)
    sync_start: Any = None
    synced: Any = None
    end: Any = None
    tainted: bool = False


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def measure(windows: list[Window], clock: Clock) -> CommShare | None:
    """Turn complete, untainted windows of one accumulation into a CommShare."""
    usable = [
        w
        for w in windows
        if not w.tainted and w.previous_end is not None and w.end is not None and w.unsynced
    ]
    if not usable:
        return None
    clock.wait(usable[-1].end)
    micro = _median([clock.seconds(s, e) for w in usable for s, e in w.unsynced])
    synced = _median([clock.seconds(w.sync_start, w.synced) for w in usable])
    return CommShare(
        accumulation=usable[0].accumulation,
        step_s=_median([clock.seconds(w.previous_end, w.end) for w in usable]),
        micro_batch_s=micro,
        comm_s=max(0.0, synced - micro),
        optimizer_s=_median([clock.seconds(w.synced, w.end) for w in usable]),
    )


class WindowTimer:
    """Stamps the windows of one fit and hands over those ready for a measurement.

    Example::

        >>> class Ticks:  # a clock whose stamps are the seconds given
        ...     times = iter([0.0, 0.1, 0.2, 0.2, 0.5, 0.6])
        ...     def now(self): return next(self.times)
        ...     def seconds(self, start, end): return end - start
        ...     def wait(self, stamp): pass
        >>> timer = WindowTimer(Ticks())
        >>> timer.last_end = timer.clock.now()  # the previous window ended at 0.0
        >>> timer.open_window(accumulation=2)
        >>> timer.micro_batch_start(synchronises=False); timer.micro_batch_end(closes=False)
        >>> timer.micro_batch_start(synchronises=True); timer.optimizer_step()
        >>> timer.micro_batch_end(closes=True)
        >>> share = measure(timer.windows, timer.clock)
        >>> round(share.micro_batch_s, 3), round(share.comm_s, 3), round(share.step_s, 3)
        (0.1, 0.2, 0.6)
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock
        self.windows: list[Window] = []
        self.open: Window | None = None
        self.last_end: Any = None

    def gap(self) -> None:
        """Time spent outside training batches (validation, epoch end) is not a step's."""
        if self.open is not None:
            self.open.tainted = True
        self.last_end = None

    def clear(self) -> None:
        """Forget every window: the accumulation changed, earlier timings no longer apply."""
        self.windows = []
        self.open = None

    def open_window(self, accumulation: int) -> None:
        """Time the window that starts now (of ``accumulation`` micro-batches)."""
        self.open = Window(accumulation, self.last_end)

    def _now(self) -> Any:
        return self.clock.now() if self.clock is not None else None

    def micro_batch_start(self, synchronises: bool) -> None:
        """A micro-batch of the open window starts; the last one ``synchronises``."""
        if self.open is None:
            return
        if synchronises:
            self.open.sync_start = self._now()
        else:
            self.open.unsynced.append((self._now(), None))

    def optimizer_step(self) -> None:
        """The synchronising micro-batch's backward is done; the optimizer steps now."""
        if self.open is not None and self.clock is not None:
            self.open.synced = self.clock.now()

    def micro_batch_end(self, closes: bool) -> None:
        """A micro-batch ends; when it ``closes`` the window, the window is complete."""
        window = self.open
        if window is None or self.clock is None:
            return
        now = self.clock.now()
        if window.unsynced and window.unsynced[-1][1] is None:
            start, _ = window.unsynced[-1]
            window.unsynced[-1] = (start, now)
        if closes:
            window.end = now
            self.windows.append(window)
            self.open = None
            self.last_end = now

    def ready(self, needed: int) -> list[Window] | None:
        """The untainted windows past warm-up, once there are ``needed`` of them."""
        usable = [w for w in self.windows[WARMUP_WINDOWS:] if not w.tainted]
        return usable if len(usable) >= needed else None

    def take_measurement(
        self, needed: int, measures: bool, share: Callable[[CommShare | None], CommShare | None]
    ) -> tuple[bool, CommShare | None]:
        """Once ``needed`` windows are ready: (True, the measurement) and the windows are
        spent. Only where ``measures`` (rank 0) are they read; ``share`` hands the result
        to every rank (a broadcast), so that all decide alike. (False, None) before."""
        usable = self.ready(needed)
        if usable is None:
            return False, None
        measured = measure(usable, self.clock) if measures and self.clock is not None else None
        self.windows = []
        return True, share(measured)
