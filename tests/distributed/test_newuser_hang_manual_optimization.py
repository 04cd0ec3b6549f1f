"""HangWatchdog under manual optimization: a batch that passes backward and the optimizer
step twice (a GAN's discriminator, then its generator) names the rank that is behind.

Ranks were ordered by the place of their last phase in PHASES: a rank waiting in the
second ``manual_backward``'s all-reduce ("backward") was put behind one still computing
the generator's loss after the first optimizer step ("optimizer step"): the report named
the waiting rank and cleared the late one.
"""

from __future__ import annotations

from pathlib import Path

from lightning_speedkit.distributed.hang_watchdog import RankProgress, late_ranks

from .test_hang_watchdog import ranks

FIRST_PASS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")


def test_a_rank_in_its_second_backward_is_ahead_of_one_after_its_first_step(
    tmp_path: Path,
) -> None:
    (r0, r1), _, _ = ranks(tmp_path, 2, timeout=2)
    for r in (r0, r1):
        r.start()
        for hook in FIRST_PASS:  # the discriminator's loss, backward and step
            r.phase(hook)
    r0.clock.now += 0.5
    r0.phase("on_before_backward")  # the generator's backward: rank 0 waits in its all-reduce
    (own1,) = r1.look(after=2.0)  # rank 1 is still in the generator's forward
    assert (own1.kind, own1.rank) == ("overrun", 1)
    events = r0.look()
    assert [e.kind for e in events] == ["overrun", "report"]
    report = events[1]
    assert [p.rank for p in report.behind] == [1]
    assert [(p.rank, p.phase, p.passed) for p in report.progress] == [
        (0, "backward", 4), (1, "optimizer step", 3),
    ]  # fmt: skip
    text = (tmp_path / "hang-report.txt").read_text()
    assert "rank 0: batch 1 (global step 0), backward (phase 4 of the batch) for 2.0 s\n" in text
    assert "rank 1: batch 1 (global step 0), optimizer step for 2.5 s   <- behind" in text
    assert "Behind: rank 1 (batch 1, optimizer step)." in text


def test_phases_passed_order_ranks_and_default_to_the_phase_order() -> None:
    second_backward = RankProgress(0, 7, 6, "backward", 1.0, passed=4)
    first_step = RankProgress(1, 7, 6, "optimizer step", 1.0, passed=3)
    assert late_ranks([second_backward, first_step]) == [first_step]
    # Without a count (automatic optimization's single pass) the phases' order holds.
    assert late_ranks([RankProgress(0, 7, 6, "backward", 1.0),
                       RankProgress(1, 7, 6, "forward", 1.0)])[0].rank == 1  # fmt: skip
    # An automatic step's phases say nothing more; between steps never says "again".
    assert (
        RankProgress(0, 7, 6, "backward", 1.0, passed=1).describe().endswith("backward for 1.0 s")
    )
    assert "phase" not in RankProgress(0, 7, 6, "between steps", 1.0, passed=8).describe()
