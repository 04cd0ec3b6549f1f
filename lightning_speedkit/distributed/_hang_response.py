"""What the watchdog does at a look: dump, alarm the others, answer their alarms, report.

Given what :class:`~lightning_speedkit.distributed._hang_detection.StepWatch` saw at a
look, :class:`HangResponse` raises the alarm and writes this rank's stacks once per
batch and side of its step, answers another rank's alarm with its stacks and where it
is, records a step that recovered, and on rank 0 collects every rank's answer and names
the late ones. Each becomes a :class:`HangEvent`. No Trainer and no thread: the store
and the time come in as arguments.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lightning_speedkit.distributed._hang_detection import (
    Mark,
    Overrun,
    StepWatch,
    Where,
    progress_of,
    where_of,
)
from lightning_speedkit.distributed._hang_report import (
    RankProgress,
    late_ranks,
    report_text,
    write_report,
)
from lightning_speedkit.distributed._hang_stacks import (
    dump_stacks,
    stacks_header,
    where_stacks_went,
)
from lightning_speedkit.distributed._hang_store import StoreLink

__all__ = ["HangEvent", "HangResponse", "Site"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HangEvent:
    """One thing the watchdog saw, in :attr:`HangWatchdog.events`.

    Attributes:
        kind: ``"overrun"``: this rank's step ran past its limit (stacks written);
            ``"alarm"``: another rank's step did, and this rank wrote its stacks;
            ``"report"`` (rank 0 only): where every rank was, the late ones in ``behind``;
            ``"recovered"``: the step that overran finished after ``seconds``.
        rank: The rank that recorded the event.
        batch: The batch it concerns (see :attr:`RankProgress.batch`).
        step: ``trainer.global_step`` when that batch started.
        seconds: ``overrun``: how long the step had run; ``recovered``: how long it took;
            ``alarm`` and ``report``: how long this rank had been in its current phase.
        threshold: The limit the step was held to, in seconds.
        path: The stack dump (``overrun``, ``alarm``) or report file written, if any.
        behind: ``report``: the ranks behind, where each was.
        silent: ``report``: the ranks that did not say where they were.
        progress: ``report``: where every rank that answered was.
        between: ``overrun`` and ``recovered``: of the time after the batch's step (its
            end, the next batch's fetch; ``seconds`` counted from the step's end), not of
            the step. Ranks waiting for one stuck there wait between steps too:
            Lightning 2.6 starts every batch with a broadcast from rank 0.
    """

    kind: Literal["overrun", "alarm", "report", "recovered"]
    rank: int
    batch: int
    step: int
    seconds: float
    threshold: float
    path: str | None = None
    behind: tuple[RankProgress, ...] = ()
    silent: tuple[int, ...] = ()
    progress: tuple[RankProgress, ...] = ()
    between: bool = False


@dataclass(frozen=True)
class Site:
    """This rank in the job: who it is, where its files go, its side of the store."""

    rank: int
    world_size: int
    directory: Path
    link: StoreLink
    wait: float
    """How long rank 0 waits for the other ranks' answers (seconds)."""


class HangResponse:
    """The response to what a look saw; remembers where this rank last dumped its stacks.

    Args:
        events: The list each :class:`HangEvent` is appended to, as it happens.
    """

    def __init__(self, events: list[HangEvent]) -> None:
        self.events = events
        self.dumped: Where | None = None  # where this rank last dumped its stacks
        self.dump_path: str | None = None

    def look(self, now: float, watch: StepWatch, site: Site) -> bool:
        """One look at ``now``: a recovered step, this rank's overrun, another rank's alarm;
        rank 0's report after a dump. Whether this rank dumped its stacks."""
        mark = watch.mark
        self.recovered(watch, site.rank)
        overrun = watch.overrun(mark, now)
        dumped = overrun is not None and self._overran(overrun, mark, now, site)
        if site.link.new_alarm() and self.dumped != where_of(mark):
            self._alarmed(mark, now, site, watch.limit())
            dumped = True
        if dumped and site.world_size > 1 and site.rank == 0:
            self._report(progress_of(mark, site.rank, now), watch.limit(), site)
        return dumped

    def recovered(self, watch: StepWatch, rank: int) -> None:
        """Record the step that overran, if it has finished since."""
        recovery = watch.recovery()
        if recovery is not None:
            self.events.append(HangEvent("recovered", rank, recovery.batch, recovery.step,
                                         recovery.seconds, recovery.limit,
                                         between=recovery.between))  # fmt: skip
            recovery.warn(rank)

    def _overran(self, overrun: Overrun, mark: Mark | None, now: float, site: Site) -> bool:
        """This rank's step overran: alarm and dump, unless it dumped there already (an
        alarm came first). Whether it dumped."""
        dumping = self.dumped != overrun.where
        path = self.dump_path if not dumping else None
        if dumping:
            site.link.raise_alarm()  # first: the other ranks start dumping now
            path = self._dump(mark, now, overrun.why, site)
        self.events.append(HangEvent("overrun", site.rank, overrun.batch, overrun.step,
                                     overrun.seconds, overrun.limit, path,
                                     between=overrun.between))  # fmt: skip
        overrun.warn(site.rank, where_stacks_went(path))
        return dumping

    def _alarmed(self, mark: Mark | None, now: float, site: Site, limit: float) -> None:
        """Another rank's step overran: dump wherever this rank is."""
        path = self._dump(mark, now, "another rank's step ran past its limit", site)
        at = progress_of(mark, site.rank, now)
        self.events.append(HangEvent("alarm", site.rank, at.batch, at.step, at.seconds, limit,
                                     path))  # fmt: skip
        log.warning(
            "HangWatchdog: rank %d: another rank raised a hang alarm; this rank is at "
            "batch %d (global step %d), %s; %s",
            site.rank, at.batch, at.step, at.phase, where_stacks_went(path),
        )  # fmt: skip

    def _dump(self, mark: Mark | None, now: float, why: str, site: Site) -> str | None:
        """Write this rank's stacks; publish where it is to the store. Returns the file path."""
        self.dumped = where_of(mark)
        progress = progress_of(mark, site.rank, now)
        site.link.publish(progress)
        header = stacks_header(site.rank, site.world_size, why, progress)
        self.dump_path = dump_stacks(site.directory, site.rank, header)
        return self.dump_path

    def _report(self, own: RankProgress, limit: float, site: Site) -> None:
        """Rank 0: wait for every rank's progress (a few seconds at most); name the late ones."""
        progress, silent = site.link.collect(own, site.world_size, site.wait)
        behind = tuple(late_ranks(progress))
        text = report_text(progress, behind, silent, limit, site.directory)
        written = write_report(site.directory, text)
        self.events.append(HangEvent("report", 0, own.batch, own.step, own.seconds, limit,
                                     written, behind, silent, progress))  # fmt: skip
        log.warning("%s", text.rstrip())
        site.link.reported()
