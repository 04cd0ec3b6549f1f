"""Where each rank was at a hang, which ranks are behind, and rank 0's report of it.

Each rank's progress is a (batch, phase) pair (see
:mod:`lightning_speedkit.distributed.hang_watchdog`): ranks at the furthest pair are
waiting, every rank at an earlier one is behind. The report is the text rank 0 logs and
writes to ``hang-report.txt``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PHASES", "RankProgress", "late_ranks", "report_text", "write_report"]

#: Phases of a training batch, in the order a rank passes them (see ``hang_watchdog``).
#: The first five are watched; validation, a checkpoint's save, the end of an epoch
#: (until the next batch starts) and a pause one of the kit's callbacks takes on purpose
#: (NumWorkersTuner's search, which holds every rank) are not.
PHASES = (
    "forward", "backward", "after backward", "optimizer step", "between steps",
    "validating", "saving a checkpoint", "epoch end", "paused by a kit callback",
)  # fmt: skip
FORWARD, BACKWARD, AFTER_BACKWARD, OPTIMIZER, BETWEEN = range(5)
VALIDATING, SAVING, EPOCH_END, PAUSED = range(5, 9)

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
        passed: Phases the rank had entered in that batch (None: as many as ``phase``'s
            place in :data:`PHASES`, the order of a batch of automatic optimization).
            Every rank passes the same hooks in a batch, so this orders ranks where a
            batch enters a phase more than once: manual optimization's several
            ``manual_backward`` and optimizer steps (a GAN's two). Left out of equality:
            a RankProgress compares by the place it names (batch, step, phase, seconds).
    """

    rank: int
    batch: int
    step: int
    phase: str
    seconds: float
    passed: int | None = field(default=None, compare=False)

    @property
    def position(self) -> tuple[int, int]:
        """(batch, phases passed in it): a rank at a smaller position is behind."""
        passed = self.passed if self.passed is not None else PHASES.index(self.phase)
        return self.batch, passed

    def describe(self) -> str:
        """``rank 1: batch 12 (global step 11), forward for 2.3 s``; a phase entered again
        in the batch (manual optimization) says which time: ``backward (phase 5 of the batch)``."""
        index = PHASES.index(self.phase)
        repeatable = BACKWARD <= index < BETWEEN  # entered again only by manual optimization
        again = self.passed is not None and repeatable and self.passed > index
        which = f" (phase {self.passed} of the batch)" if again else ""
        return (
            f"rank {self.rank}: batch {self.batch} (global step {self.step}), "
            f"{self.phase}{which} for {self.seconds:.1f} s"
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
    furthest = max(p.position for p in progress)
    return [p for p in progress if p.position < furthest]


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
