"""The abort: every rank leaves in order, says why, and ends with status 75."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_speedkit.distributed._hang_abort import HANG_EXIT_CODE, abort
from lightning_speedkit.distributed._hang_store import StoreLink

from .test_hang_store import Time
from .test_hang_watchdog import DictStore


@pytest.mark.parametrize(("stacks", "shown"), [("d/hang-rank1.txt", "d/hang-rank1.txt"),
                                               (None, "printed to stderr above")])  # fmt: skip
def test_a_rank_leaves_after_the_report_and_exits_75(
    stacks: str | None, shown: str, caplog: pytest.LogCaptureFixture
) -> None:
    store, time = DictStore(), Time()
    store.data["reports"] = 1  # rank 0 has reported
    link = StoreLink(store, 1, clock=time.clock, sleep=time.sleep)
    exits: list[tuple[int, int]] = []
    abort(link, 2, 5.0, stacks=stacks, report=Path("d/hang-report.txt"),
          exit=lambda code: exits.append((code, store.data["leaving"])))  # fmt: skip
    assert exits == [(HANG_EXIT_CODE, 1)] == [(75, 1)]  # it said it leaves, then left
    assert time.slept == []
    assert caplog.messages == [
        f"HangWatchdog: a training step hung (action='abort'): ending rank 1 with exit status "
        f"75. Stacks: {shown}; rank 0's report: d/hang-report.txt. Restart the job from its "
        f"last checkpoint; see the troubleshooting page's 'Distributed hangs'."
    ]


def test_rank_0_leaves_last() -> None:
    """It hosts the store: it waits (3 s at most) for the others to say they leave."""
    store, time = DictStore(), Time()
    link = StoreLink(store, 0, clock=time.clock, sleep=time.sleep)
    exits: list[float] = []
    abort(link, 3, 5.0, stacks=None, report=Path("r"), exit=lambda code: exits.append(time.now))
    assert exits == [3.0]  # nobody said so: it waited its 3 s
    time.now = 0.0
    store.data["leaving"] = 2
    abort(link, 3, 5.0, stacks=None, report=Path("r"), exit=lambda code: exits.append(time.now))
    assert exits[1] == 0.0  # both others left: at once
