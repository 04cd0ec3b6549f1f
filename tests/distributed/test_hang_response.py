"""HangResponse: what one look does, on exact clock readings and a dict for the store."""

from __future__ import annotations

from pathlib import Path

from lightning_speedkit.distributed._hang_detection import StepWatch
from lightning_speedkit.distributed._hang_report import VALIDATING, RankProgress
from lightning_speedkit.distributed._hang_response import HangEvent, HangResponse, Site
from lightning_speedkit.distributed._hang_store import StoreLink

from .test_hang_watchdog import DictStore


def rank(tmp_path: Path, r: int, world: int, store: DictStore | None) -> tuple[StepWatch, Site]:
    site = Site(r, world, tmp_path, StoreLink(store, r), wait=0.2)
    return StepWatch(timeout=2.0, factor=10.0, min_timeout=60.0), site


def test_one_dump_per_step_then_the_recovery(tmp_path: Path) -> None:
    watch, site = rank(tmp_path, 0, 1, None)
    events: list[HangEvent] = []
    response = HangResponse(events)
    watch.start(now=10.0, global_step=4)
    assert not response.look(12.0, watch, site)  # at the limit
    assert response.look(12.5, watch, site)
    path = str(tmp_path / "hang-rank0.txt")
    assert events == [HangEvent("overrun", 0, 1, 4, 2.5, 2.0, path)]
    assert "why: this rank's step ran 2.5 s, past its limit of 2.0 s" in Path(path).read_text()
    assert not response.look(30.0, watch, site)  # the same step: no second dump
    watch.end(now=31.0)
    assert not response.look(31.5, watch, site)
    assert events[1:] == [HangEvent("recovered", 0, 1, 4, 21.0, 2.0)]
    assert (response.dumped, response.dump_path) == ((1, False), path)


def test_the_alarm_is_answered_and_rank_0_names_the_late_rank(tmp_path: Path) -> None:
    """Rank 1's step overruns; rank 0 is validating (unwatched): it dumps on the alarm,
    and its report names itself behind (an earlier batch)."""
    store = DictStore()
    (w0, s0), (w1, s1) = rank(tmp_path, 0, 2, store), rank(tmp_path, 1, 2, store)
    e0: list[HangEvent] = []
    e1: list[HangEvent] = []
    r0, r1 = HangResponse(e0), HangResponse(e1)
    for watch in (w0, w1):
        watch.start(now=0.0, global_step=0)
        watch.end(now=0.5)
    w0.enter(VALIDATING, now=0.5)
    w1.start(now=0.5, global_step=1)
    assert r1.look(3.0, w1, s1)
    assert e1 == [HangEvent("overrun", 1, 2, 1, 2.5, 2.0, str(tmp_path / "hang-rank1.txt"))]
    assert store.data["alarms"] == 1
    assert r0.look(3.0, w0, s0)
    validating = RankProgress(0, 1, 0, "validating", 2.5)
    forward = RankProgress(1, 2, 1, "forward", 2.5)
    assert e0 == [
        HangEvent("alarm", 0, 1, 0, 2.5, 2.0, str(tmp_path / "hang-rank0.txt")),
        HangEvent("report", 0, 1, 0, 2.5, 2.0, str(tmp_path / "hang-report.txt"),
                  behind=(validating,), silent=(), progress=(validating, forward)),
    ]  # fmt: skip
    assert store.data["reports"] == 1
    report = (tmp_path / "hang-report.txt").read_text()
    assert "Behind: rank 0 (batch 1, validating)." in report
    assert not r1.look(3.5, w1, s1)  # its own alarm is no news to it
    assert len(e1) == 1
