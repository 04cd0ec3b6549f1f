"""StoreLink: the watchdogs' counters and answers, on a dict standing in for the store."""

from __future__ import annotations

import pytest

from lightning_speedkit.distributed._hang_report import RankProgress
from lightning_speedkit.distributed._hang_store import StoreLink

from .test_hang_watchdog import DictStore


class Time:
    """A clock that only the link's sleeps move."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now = round(self.now + seconds, 9)  # no float drift over many sleeps


def links(store: DictStore, world: int, time: Time | None = None) -> list[StoreLink]:
    time = time or Time()
    return [StoreLink(store, r, clock=time.clock, sleep=time.sleep) for r in range(world)]


def where(rank: int, phase: str = "forward") -> RankProgress:
    return RankProgress(rank, 3, 2, phase, 1.5)


def test_an_alarm_is_news_once_to_every_other_rank() -> None:
    store = DictStore()
    r0, r1, r2 = links(store, 3)
    r1.raise_alarm()
    assert store.data["alarms"] == 1
    assert (r1.new_alarm(), r0.new_alarm(), r2.new_alarm()) == (False, True, True)
    assert (r0.new_alarm(), r2.new_alarm()) == (False, False)


def test_counters_of_an_earlier_fit_are_no_news() -> None:
    store = DictStore()
    store.data.update(alarms=3, reports=2, leaving=1)
    (link,) = links(store, 1)
    link.catch_up()
    assert (link.alarms_seen, link.reported_upto, link.reports_seen, link.leaving_seen) == (
        3, 3, 2, 1,
    )  # fmt: skip
    assert not link.new_alarm()


def test_rank_0_collects_the_answers_and_names_the_silent() -> None:
    store, time = DictStore(), Time()
    r0, r1, _, r3 = links(store, 4, time)
    r1.raise_alarm()
    for link in (r0, r3):
        link.new_alarm()
    r1.publish(where(1))
    r3.publish(where(3, "backward"))
    progress, silent = r0.collect(where(0, "backward"), 4, wait=0.2)
    assert progress == (where(0, "backward"), where(1), where(3, "backward"))
    assert silent == (2,)
    assert time.now == 0.25  # waited past 0.2 s, in steps of 0.05 s
    # the answers to this alarm are spent: the next report waits for fresh ones
    assert r0.read(1) is None
    r3.raise_alarm()
    r1.new_alarm()
    r1.publish(where(1, "optimizer step"))
    assert r0.read(1) == where(1, "optimizer step")


def test_collect_returns_as_soon_as_every_rank_answered() -> None:
    store, time = DictStore(), Time()
    r0, r1 = links(store, 2, time)
    r0.raise_alarm()
    r1.new_alarm()
    r1.publish(where(1))
    assert r0.collect(where(0), 2, wait=5.0) == ((where(0), where(1)), ())
    assert time.slept == []


def test_leaving_in_order() -> None:
    """The others wait for rank 0's report, then say so; rank 0 waits for them."""
    store, time = DictStore(), Time()
    r0, r1, r2 = links(store, 3, time)
    r1.leave(3, wait=1.0)  # no report comes: it waits 1 + 3 s, then leaves anyway
    assert time.now == 4.0
    assert store.data["leaving"] == 1
    r0.reported()
    before = time.now
    r2.leave(3, wait=1.0)  # the report is there: it leaves at once
    assert (time.now, store.data["leaving"]) == (before, 2)
    r0.leave(3, wait=1.0)  # both others have left
    assert time.now == before
    assert (r0.quiet, r1.quiet) == (True, True)  # a store gone now is expected


def test_a_failing_store_is_dropped_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(DictStore):
        def add(self, key: str, amount: int) -> int:
            raise ConnectionError("rank 0 is gone")

    (link,) = links(Broken(), 1)
    assert not link.new_alarm()
    assert link.store is None
    link.raise_alarm()
    assert caplog.messages == [
        "HangWatchdog: rank 0 lost the rendezvous store (rank 0 is gone); it goes on watching "
        "its own steps only"
    ]
