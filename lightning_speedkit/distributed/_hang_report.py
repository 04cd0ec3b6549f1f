"""Where each rank was at a hang, which ranks are behind, and rank 0's report of it.

Each rank's progress is a (batch, phase) pair (see
:mod:`lightning_speedkit.distributed.hang_watchdog`): ranks at the furthest pair are
waiting, every rank at an earlier one is behind. The report is the text rank 0 logs and
writes to ``hang-report.txt``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PHASES", "RankProgress", "late_ranks", "report_text", "write_report"]

#: Phases of a training batch, in the order a rank passes them (see ``hang_watchdog``).
#: The first five are watched; validation, a checkpoint's save and the end of an epoch
#: (until the next batch starts) are not.
PHASES = (
    "forward", "backward", "after backward", "optimizer step", "between steps",
    "validating", "saving a checkpoint", "epoch end",
)  # fmt: skip
FORWARD, BACKWARD, AFTER_BACKWARD, OPTIMIZER, BETWEEN = range(5)
VALIDATING, SAVING, EPOCH_END = range(5, 8)

#: The report's file, in the watchdog's directory (rank 0's filesystem).
REPORT_FILE = "hang-report.txt"


@dataclass(frozen=True)
class RankProgress:
    """Where one rank was when the watchdogs dumped their stacks.

    Attributes:
        rank: The global rank.
        batch: Training batches this rank had started in this ``fit`` (1 is the first;
            0: none yet). Every rank starts the same batches, so equal numbers are the
            same batch.
        step: ``trainer.global_step`` when that batch started (optimizer steps taken).
        phase: The last phase the rank entered, one of :data:`PHASES`.
        seconds: How long it had been in that phase.
    """

    rank: int
    batch: int
    step: int
    phase: str
    seconds: float

    def describe(self) -> str:
        """``rank 1: batch 12 (global step 11), forward for 2.3 s``."""
        return (
            f"rank {self.rank}: batch {self.batch} (global step {self.step}), "
            f"{self.phase} for {self.seconds:.1f} s"
        )


def late_ranks(progress: Sequence[RankProgress]) -> list[RankProgress]:
    """The ranks behind the furthest: an earlier batch, or an earlier phase of the same batch.

    Example::

        >>> waiting = RankProgress(rank=0, batch=12, step=11, phase="backward", seconds=2.1)
        >>> sleeping = RankProgress(rank=1, batch=12, step=11, phase="forward", seconds=2.2)
        >>> [p.rank for p in late_ranks([waiting, sleeping])]
        [1]
        >>> late_ranks([waiting])
        []
    """
    if not progress:
        return []

    def position(p: RankProgress) -> tuple[int, int]:
        return p.batch, PHASES.index(p.phase)

    furthest = max(position(p) for p in progress)
    return [p for p in progress if position(p) < furthest]


def report_text(
    progress: Sequence[RankProgress],
    behind: Sequence[RankProgress],
    silent: Sequence[int],
    limit: float,
    directory: Path,
) -> str:
    """Rank 0's report: where each rank was, the late ones marked, then who is behind.

    Example::

        >>> from pathlib import Path
        >>> ranks = [RankProgress(0, 3, 2, "backward", 2.0), RankProgress(1, 3, 2, "forward", 2.5)]
        >>> print(report_text(ranks, late_ranks(ranks), [2], 2.0, Path("runs")), end="")
        HangWatchdog: a training step ran past its limit of 2.0 s. Where each rank was:
          rank 0: batch 3 (global step 2), backward for 2.0 s
          rank 1: batch 3 (global step 2), forward for 2.5 s   <- behind
          rank 2: no answer (process gone, or its interpreter lock held)
        Behind: rank 1 (batch 3, forward).
        Silent: rank 2.
        Stacks: runs/hang-rank{R}.txt on each rank's filesystem.
    """
    late = {p.rank for p in behind}
    lines = [f"HangWatchdog: a training step ran past its limit of {limit:.1f} s. "
             f"Where each rank was:"]  # fmt: skip
    lines += [f"  {p.describe()}{'   <- behind' if p.rank in late else ''}" for p in progress]
    lines += [f"  rank {r}: no answer (process gone, or its interpreter lock held)"
              for r in silent]  # fmt: skip
    if behind:
        named = ", ".join(f"rank {p.rank} (batch {p.batch}, {p.phase})" for p in behind)
        lines.append(f"Behind: {named}.")
    elif progress and all(p.phase == PHASES[BETWEEN] for p in progress):
        lines.append(
            "Behind: no rank by progress: all were between steps of one batch. Lightning "
            "starts each batch with a broadcast from rank 0: the rank whose stacks are not "
            "in `_broadcast_sigterm_tensor` is the one the others wait for."
        )
    else:
        lines.append("Behind: no rank by progress: all were at the same batch and phase.")
    if silent:
        lines.append(f"Silent: {', '.join(f'rank {r}' for r in silent)}.")
    lines.append(f"Stacks: {directory / 'hang-rank{R}.txt'} on each rank's filesystem.")
    return "\n".join(lines) + "\n"


def write_report(directory: Path, text: str) -> str | None:
    """``text`` to ``directory/hang-report.txt``; its path, or None where it cannot be
    written (the report is in the log as well)."""
    path = directory / REPORT_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError:
        return None
    return str(path)
