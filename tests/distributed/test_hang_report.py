"""Which ranks are behind, and the text of rank 0's report, on exact progress."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_speedkit.distributed._hang_report import (
    RankProgress,
    late_ranks,
    report_text,
    write_report,
)

HEAD = "HangWatchdog: a training step ran past its limit of 2.0 s. Where each rank was:"
TAIL = "Stacks: runs/hang-rank{R}.txt on each rank's filesystem."


def test_the_late_rank_is_marked_and_named() -> None:
    ranks = [RankProgress(0, 4, 3, "backward", 2.0), RankProgress(1, 4, 3, "forward", 2.5)]
    assert report_text(ranks, late_ranks(ranks), [], 2.0, Path("runs")).splitlines() == [
        HEAD,
        "  rank 0: batch 4 (global step 3), backward for 2.0 s",
        "  rank 1: batch 4 (global step 3), forward for 2.5 s   <- behind",
        "Behind: rank 1 (batch 4, forward).",
        TAIL,
    ]


@pytest.mark.parametrize(
    ("phase", "verdict"),
    [
        ("between steps", "Behind: no rank by progress: all were between steps of one batch. "
         "Lightning starts each batch with a broadcast from rank 0: the rank whose stacks are "
         "not in `_broadcast_sigterm_tensor` is the one the others wait for."),
        ("backward", "Behind: no rank by progress: all were at the same batch and phase."),
    ],
)  # fmt: skip
def test_no_rank_behind(phase: str, verdict: str) -> None:
    ranks = [RankProgress(r, 4, 3, phase, 1.0) for r in range(2)]
    lines = report_text(ranks, late_ranks(ranks), [2], 2.0, Path("runs")).splitlines()
    assert lines[3:] == [
        "  rank 2: no answer (process gone, or its interpreter lock held)",
        verdict,
        "Silent: rank 2.",
        TAIL,
    ]


def test_the_report_file(tmp_path: Path) -> None:
    assert write_report(tmp_path / "new", "text\n") == str(tmp_path / "new" / "hang-report.txt")
    assert (tmp_path / "new" / "hang-report.txt").read_text() == "text\n"
    (tmp_path / "a-file").write_text("")
    assert write_report(tmp_path / "a-file", "text\n") is None  # under a file: not written
