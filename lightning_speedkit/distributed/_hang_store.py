"""The watchdogs' protocol over the process group's rendezvous store.

Not a collective (that is what hangs): the TCP key-value store the ranks met through,
served by its own thread in rank 0's process. Three counters and one key per rank:

- ``alarms``: a rank whose step overran adds 1; every rank that sees it grow dumps;
- ``progress/{R}``: where rank R was when it dumped, with the alarm count it answers;
- ``reports``: rank 0 adds 1 once it has reported (ranks that abort wait for it);
- ``leaving``: ranks other than 0 add 1 as they abort; rank 0, which hosts the store,
  leaves last.

Counters of earlier fits stay in the store: each rank reads them at setup
(:meth:`StoreLink.catch_up`) and treats only what comes after as news.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from lightning_speedkit import _compat
from lightning_speedkit.distributed._hang_report import RankProgress

__all__ = ["ANSWER_WAIT", "StoreLink", "open_store"]

log = logging.getLogger(__name__)

#: How long rank 0 waits for the other ranks' progress after an alarm, at least (seconds).
ANSWER_WAIT = 5.0
PREFIX = "speedkit/hang_watchdog"
ALARMS, REPORTS, LEAVING = "alarms", "reports", "leaving"


class StoreLink:
    """One rank's side of the protocol, and what it has seen of the counters.

    ``store`` needs ``add``, ``set``, ``get`` and ``check`` (a ``torch.distributed.Store``;
    in tests, a dict behind those four). A store that fails is dropped (said once): the
    watchdog goes on watching its own steps. ``clock`` and ``sleep`` pace the waits.

    Example::

        >>> class DictStore(dict):
        ...     def add(self, key, amount):
        ...         self[key] = self.get(key, 0) + amount
        ...         return self[key]
        >>> store = DictStore()
        >>> first, second = StoreLink(store, rank=0), StoreLink(store, rank=1)
        >>> first.raise_alarm()
        >>> second.new_alarm(), second.new_alarm()  # news once
        (True, False)
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] = time.sleep,
    ) -> None:
        self.store, self.rank, self.clock, self.sleep = store, rank, clock, sleep
        self.quiet = False  # leaving: a store gone is expected, logged at debug level
        self.alarms_seen = self.reports_seen = self.reported_upto = self.leaving_seen = 0

    def call(self, call: Callable[[Any], Any]) -> Any:
        """``call(store)``, or None without a store; a store that fails is dropped, said once."""
        if self.store is None:
            return None
        try:
            return call(self.store)
        except Exception as error:  # the store's host process died, or the network did
            log.log(
                logging.DEBUG if self.quiet else logging.WARNING,
                "HangWatchdog: rank %d lost the rendezvous store (%s); it goes on watching "
                "its own steps only",
                self.rank, error,
            )  # fmt: skip
            self.store = None
            return None

    def catch_up(self) -> None:
        """Read the counters earlier fits left: only what comes after them is news."""
        self.alarms_seen = self.reported_upto = self.call(lambda s: s.add(ALARMS, 0)) or 0
        self.reports_seen = self.call(lambda s: s.add(REPORTS, 0)) or 0
        self.leaving_seen = self.call(lambda s: s.add(LEAVING, 0)) or 0

    # -- alarms and answers ------------------------------------------------------------------------

    def raise_alarm(self) -> None:
        """Tell every rank to dump its stacks (this rank's own alarm is no news to it)."""
        count = self.call(lambda s: s.add(ALARMS, 1))
        if count is not None:
            self.alarms_seen = count

    def new_alarm(self) -> bool:
        """Whether an alarm was raised since this rank last looked."""
        count = self.call(lambda s: s.add(ALARMS, 0))
        if count is not None and count > self.alarms_seen:
            self.alarms_seen = count
            return True
        return False

    def publish(self, progress: RankProgress) -> None:
        """Say where this rank is, as its answer to the alarms seen so far."""
        if self.store is None:
            return
        answer = json.dumps({**dataclasses.asdict(progress), "alarm": self.alarms_seen})
        self.call(lambda s: s.set(f"progress/{progress.rank}", answer))

    def read(self, rank: int) -> RankProgress | None:
        """Where ``rank`` said it was, if it answered an alarm not yet reported."""
        key = f"progress/{rank}"
        raw = self.call(lambda s: s.get(key) if s.check([key]) else None)
        if raw is None:
            return None
        fields = json.loads(raw)
        if int(fields.pop("alarm")) <= self.reported_upto:
            return None  # an answer to an alarm already reported
        return RankProgress(**fields)

    def collect(
        self, own: RankProgress, world_size: int, wait: float
    ) -> tuple[tuple[RankProgress, ...], tuple[int, ...]]:
        """Every rank's answer, waiting up to ``wait`` seconds: (progress by rank, silent
        ranks). The alarms raised so far count as reported: their answers are not reused."""
        answers: dict[int, RankProgress] = {own.rank: own}
        deadline = self.clock() + wait
        while self.store is not None and len(answers) < world_size:
            for rank in range(world_size):
                if rank not in answers:
                    found = self.read(rank)
                    if found is not None:
                        answers[rank] = found
            if len(answers) == world_size or self.clock() > deadline:
                break
            self.sleep(0.05)
        count = self.call(lambda s: s.add(ALARMS, 0))
        self.reported_upto = max(self.reported_upto, count or 0)
        progress = tuple(answers[r] for r in sorted(answers))
        return progress, tuple(r for r in range(world_size) if r not in answers)

    def reported(self) -> None:
        """Rank 0 has reported: the ranks that abort may leave."""
        self.call(lambda s: s.add(REPORTS, 1))

    # -- leaving -----------------------------------------------------------------------------------

    def leave(self, world_size: int, wait: float) -> None:
        """Before this process ends: the others wait for rank 0's report (``wait`` seconds
        and 3 more at most), then say they leave; rank 0, which hosts the store, waits for
        them (3 s at most), so that no rank loses the store midway."""
        self.quiet = True
        if self.rank != 0:
            self._wait_for(REPORTS, self.reports_seen + 1, deadline=self.clock() + wait + 3)
            self.call(lambda s: s.add(LEAVING, 1))
        else:
            others = self.leaving_seen + world_size - 1
            self._wait_for(LEAVING, others, deadline=self.clock() + 3)

    def _wait_for(self, key: str, value: int, deadline: float) -> None:
        """Until the counter ``key`` reaches ``value``, the store is gone, or the deadline."""
        while self.store is not None and self.clock() < deadline:
            count = self.call(lambda s: s.add(key, 0))
            if count is None or count >= value:
                return
            self.sleep(0.05)


def open_store() -> Any:
    """A connection of the watchdog's own to the default process group's store, or None.

    The process group's own client is shared with the main thread, which may sit in a
    blocking ``get`` on it (NCCL exchanges its unique id through the store when a
    communicator is first used): a TCP store gets a second client, so the watchdog's
    requests never queue behind it. Another kind of store is used as it is.
    """
    # torch.distributed re-exports them from its C module without declaring it to mypy.
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    store = _compat.default_process_group_store()
    if store is None:
        return None
    base = store
    while isinstance(base, PrefixStore):
        base = base.underlying_store
    if isinstance(base, TCPStore):
        try:
            base = TCPStore(
                base.host, base.port, is_master=False, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=30),
            )  # fmt: skip
        except Exception as error:  # an unreachable host: share the group's connection
            log.debug("HangWatchdog: a second store connection failed (%s)", error)
            base = store
    return PrefixStore(PREFIX, base)
