"""When a training step, or the time between two, is past its limit: the watchdog's clockwork.

The hooks hand :class:`StepWatch` their clock readings (a batch starts, enters a phase,
ends); the watchdog's thread asks it, with the time of its look, whether the step is past
its limit (:meth:`StepWatch.overrun`) and whether a step that was has finished since
(:meth:`StepWatch.recovery`). No clock of its own, no thread, no Trainer: tests pass
exact times.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_speedkit.distributed._hang_report import (
    BETWEEN,
    FORWARD,
    PAUSED,
    PHASES,
    VALIDATING,
    RankProgress,
)

__all__ = ["WARMUP_STEPS", "Overrun", "Recovery", "StepWatch", "poll_interval", "step_limit"]

log = logging.getLogger(__name__)

#: Completed steps of a ``fit`` before the relative limit applies (the median needs them).
WARMUP_STEPS = 5
#: How many recent step durations the median is taken over.
HISTORY = 1000

# The hooks' record of the current batch, replaced whole (one attribute store, so the
# thread never reads half of an update): (batch, phase, phase since, batch start, global step,
# phases entered in the batch so far). The last orders ranks within a batch: a batch of manual
# optimization passes backward and the optimizer step more than once (a GAN's two losses).
Mark = tuple[int, int, float, float, int, int]
# A batch and whether its step is over: one overrun (and one dump) each, the step's and the
# time after it.
Where = tuple[int, bool]


def where_of(mark: Mark | None) -> Where:
    """The (batch, step over) pair a mark is at; ``(0, False)`` before the first batch."""
    return (mark[0], mark[1] >= BETWEEN) if mark is not None else (0, False)


def progress_of(mark: Mark | None, rank: int, now: float) -> RankProgress:
    """Where a mark says ``rank`` is at ``now``: between steps of batch 0 before any batch."""
    if mark is None:
        return RankProgress(rank, 0, 0, PHASES[BETWEEN], 0.0)
    batch, phase, since, _, step, passed = mark
    return RankProgress(rank, batch, step, PHASES[phase], now - since, passed)


def step_limit(
    durations: Sequence[float], timeout: float | None, factor: float, min_timeout: float
) -> float:
    """The limit a step is held to: ``timeout``, else ``factor x min_timeout`` in the warm-up,
    else ``max(min_timeout, factor x median)``.

    Example::

        >>> step_limit([], None, 10.0, 60.0)  # no median yet
        600.0
        >>> step_limit([300.0, 8.0, 9.0, 7.0, 8.0], None, 10.0, 60.0)  # from the fifth step
        80.0
        >>> step_limit([1.0, 1.0, 1.0, 1.0, 1.0], 30.0, 10.0, 60.0)
        30.0
    """
    if timeout is not None:
        return timeout
    if len(durations) < WARMUP_STEPS:
        return factor * min_timeout
    return max(min_timeout, factor * statistics.median(durations))


def poll_interval(timeout: float | None, min_timeout: float) -> float:
    """Seconds between the thread's looks: a tenth of the smallest limit, at most 1 s."""
    floor = timeout if timeout is not None else min_timeout
    return min(1.0, max(0.05, floor / 10))


@dataclass(frozen=True)
class Overrun:
    """A step (or the time after it) seen past its limit, once per batch and side of it."""

    batch: int
    step: int
    seconds: float
    """How long the step had run, or how long since it ended (``between``)."""
    limit: float
    between: bool
    where: Where

    @property
    def why(self) -> str:
        """The reason, as the stack dump's header gives it."""
        what = "has been between steps" if self.between else "step ran"
        return f"this rank's {what} {self.seconds:.1f} s, past its limit of {self.limit:.1f} s"

    def warn(self, rank: int, stacks: str) -> None:
        """Log it, with where the stacks went."""
        log.warning(
            "HangWatchdog: rank %d: batch %d (global step %d) %s %.1f s, past its "
            "limit of %.1f s; %s",
            rank, self.batch, self.step,
            "ended and the next has not begun for" if self.between else "has run",
            self.seconds, self.limit, stacks,
        )  # fmt: skip


@dataclass(frozen=True)
class Recovery:
    """A step that overran and then finished (or, ``between``, was followed by the next)."""

    batch: int
    step: int
    seconds: float
    limit: float
    between: bool

    def warn(self, rank: int) -> None:
        """Log it: the step was slow, not stuck."""
        log.warning(
            "HangWatchdog: rank %d: batch %d %s after %.1f s (limit %.1f s): it was slow, "
            "not stuck",
            rank, self.batch, "was followed" if self.between else "finished", self.seconds,
            self.limit,
        )  # fmt: skip


class StepWatch:
    """The current batch's mark and the durations of completed steps, against the limit.

    The hook methods (:meth:`start`, :meth:`enter`, :meth:`end`) store a tuple and append
    to a deque, nothing else; the thread's (:meth:`overrun`, :meth:`recovery`) read them.

    Example::

        >>> watch = StepWatch(timeout=10, factor=10, min_timeout=60)
        >>> watch.start(now=100.0, global_step=0)
        >>> watch.overrun(watch.mark, now=110.0) is None  # at the limit: not past it
        True
        >>> watch.overrun(watch.mark, now=110.5).why
        "this rank's step ran 10.5 s, past its limit of 10.0 s"
        >>> watch.overrun(watch.mark, now=200.0) is None  # seen once per step
        True
        >>> watch.end(now=112.0)
        >>> watch.recovery().seconds
        12.0
    """

    def __init__(self, timeout: float | None, factor: float, min_timeout: float) -> None:
        self.timeout, self.factor, self.min_timeout = timeout, factor, min_timeout
        self.mark: Mark | None = None
        self.steps: deque[tuple[int, float]] = deque(maxlen=HISTORY)  # (batch, seconds)
        # (batch, global step, limit, since: None for the step, the batch's end for the time
        # between steps) of an overrun not over yet
        self._pending: tuple[int, int, float, float | None] | None = None
        self._seen: Where = (0, False)  # the last (batch, after its step) overrunning
        self._paused: tuple[Mark, float] | None = None  # the mark a pause left, and when

    # -- the hooks ---------------------------------------------------------------------------------

    def start(self, now: float, global_step: int) -> None:
        """A training batch starts: its forward."""
        started = self.mark[0] if self.mark is not None else 0
        self.mark = (started + 1, FORWARD, now, now, global_step, 0)

    def enter(self, phase: int, now: float) -> None:
        """The batch enters ``phase`` (an index of :data:`PHASES`)."""
        if self.mark is not None:
            batch, _, _, start, step, passed = self.mark
            self.mark = (batch, phase, now, start, step, passed + 1)

    def end_validation(self, now: float) -> None:
        """Validation ended: back between steps, watched again from now."""
        if self.mark is not None and self.mark[1] == VALIDATING:
            self.enter(BETWEEN, now)

    def pause(self, now: float) -> None:
        """Training stops on purpose (a kit callback measuring): unwatched until :meth:`resume`."""
        if self.mark is not None and self._paused is None:
            self._paused = (self.mark, now)
            self.enter(PAUSED, now)

    def resume(self, now: float) -> None:
        """Back where the pause found the batch, its clocks moved on by the pause: the
        pause counts neither toward the step's age nor toward its duration."""
        if self._paused is not None:
            (batch, phase, since, start, step, passed), at = self._paused
            self._paused, gap = None, now - at
            self.mark = (batch, phase, since + gap, start + gap, step, passed + 2)

    def end(self, now: float) -> None:
        """The batch's step ended: its duration joins the history."""
        if self.mark is not None:
            batch, _, _, start, step, passed = self.mark
            self.steps.append((batch, now - start))
            self.mark = (batch, BETWEEN, now, start, step, passed + 1)

    # -- the thread's looks ------------------------------------------------------------------------

    def limit(self) -> float:
        """The limit, in seconds, the current step is held to (see :func:`step_limit`)."""
        # list() of a deque runs in C without releasing the GIL: the hooks cannot change it
        # half-way through.
        durations = [seconds for _, seconds in list(self.steps)]
        return step_limit(durations, self.timeout, self.factor, self.min_timeout)

    def overrun(self, mark: Mark | None, now: float) -> Overrun | None:
        """The step of ``mark`` (or the time since it ended) past its limit at ``now``, the
        first time it is seen so; None otherwise. Validation, saves and epoch ends: None."""
        batch, phase, since, start, step, _ = (
            mark if mark is not None else (0, BETWEEN, now, now, 0, 0)
        )
        floor = self.timeout if self.timeout is not None else self.min_timeout
        between = phase == BETWEEN
        age = now - (since if between else start)  # the step's age, or the time since it
        where = where_of(mark)
        if phase > BETWEEN or where <= self._seen or age <= floor:
            return None
        limit = self.limit()  # >= floor: the median is only needed past it
        if age <= limit:
            return None
        self._seen = where
        self._pending = (batch, step, limit, since if between else None)
        return Overrun(batch, step, age, limit, between, where)

    def recovery(self) -> Recovery | None:
        """The overrun step, once it has finished (the time between steps: once the rank
        moved on); None while it runs, or when there was none."""
        if self._pending is None:
            return None
        batch, step, limit, since = self._pending
        mark = self.mark
        if since is not None:  # the time between steps: over once the rank moved on
            if mark is None or (mark[0], mark[1]) == (batch, BETWEEN):
                return None
            left = mark[2] if mark[0] == batch else mark[3]  # its next phase, or batch, began
            took: float | None = left - since
        else:
            finished = [seconds for b, seconds in list(self.steps) if b == batch]
            took = finished[-1] if finished else None
        if took is not None:
            self._pending = None
            return Recovery(batch, step, took, limit, between=since is not None)
        if mark is not None and mark[0] != batch:
            self._pending = None  # it ended unseen (its duration already out of the history)
        return None
