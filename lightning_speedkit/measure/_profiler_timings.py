"""The un-profiled step time and data wait that ProfilerSchedule's report compares with.

The profiler slows the host (Python tracing, stacks), so a window's trace overstates
data wait on a CPU run and the device's idle time on a GPU run. Steps the profiler does
not record are timed here from two clock readings per step (the caller reads its
clock and passes the time): the gap from one batch's end to the next one's start (the
fetch) and from one batch's start to the next one's (the step). A pause (validation, a
checkpoint save) is no step's time: the gap it falls in is not timed.
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["UnprofiledTimings"]


class UnprofiledTimings:
    """Fetch and step seconds of the latest ``keep`` un-profiled steps, and their medians.

    Args:
        keep: steps kept (the newest).

    Example::

        >>> timings = UnprofiledTimings()
        >>> for start in (0.0, 1.0, 2.0):  # 0.25 s of fetch before each step of 1 s
        ...     timings.batch_starts(start, timed=True)
        ...     timings.batch_ends(start + 0.75)
        >>> timings.medians()
        (0.25, 1000.0)
    """

    def __init__(self, keep: int = 50) -> None:
        self.samples: tuple[deque[float], deque[float]] = (deque(maxlen=keep), deque(maxlen=keep))
        """Data fetch and step seconds of recent steps the profiler did not record."""
        self._batch_end: float | None = None
        self._batch_start: float | None = None

    def clear(self) -> None:
        """A new fit: nothing timed yet (the deques are cleared in place)."""
        for samples in self.samples:
            samples.clear()
        self._batch_end = self._batch_start = None

    def batch_starts(self, now: float, *, timed: bool) -> None:
        """A batch starts at ``now``; ``timed``: the step it ends is not the profiler's
        (a recorded step's timings are the profiler's, and its end is not timed)."""
        if not timed:
            self._batch_end = None
        elif self._batch_end is not None and self._batch_start is not None:
            self.samples[0].append(now - self._batch_end)
            self.samples[1].append(now - self._batch_start)
        self._batch_start = now

    def batch_ends(self, now: float | None) -> None:
        """A batch ends at ``now`` (``None``: a recorded step, not timed)."""
        self._batch_end = now

    def pause(self) -> None:
        """Validation or a checkpoint save: the gap it runs in is not timed (nor is the
        fetch after it, which had the pause's time to load)."""
        self._batch_end = None

    def medians(self) -> tuple[float | None, float | None]:
        """The median data-wait share of a step (at most 1) and step milliseconds; both
        ``None`` before a step with a time. Medians: the first steps of a fit
        (allocations, lazy set-up) are not typical."""
        fetches, steps = self.samples
        if not steps or statistics.median(steps) <= 0:
            return None, None
        share = min(statistics.median(fetches) / statistics.median(steps), 1.0)
        return share, 1e3 * statistics.median(steps)
