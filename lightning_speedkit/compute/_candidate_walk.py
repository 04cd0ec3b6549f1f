"""The micro-batch search itself: which sizes to try, the walk through them, and the verdict.

A pure function of measurements: the walk (and the confirmation of its verdict) asks a
``trial(n)`` for each size (a :class:`~lightning_speedkit.compute.StepMeasurement`, or
:class:`Skipped` saying why it did not count) and an ``agree(ok)`` that ranks running in
lockstep use to go on or stop together; it touches no model, loader or device, so tests
drive it with fake ones."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_speedkit.compute._memory_probe import GIB
from lightning_speedkit.compute._step_timer import StepMeasurement

__all__ = [
    "Skipped",
    "Trial",
    "candidate_sizes",
    "confirm",
    "default_candidates",
    "verdict",
    "walk",
]


@dataclass(frozen=True)
class Skipped:
    """A candidate that ran no timed step, or whose step does not count."""

    reason: str
    """Why, as the table says it."""
    stop: bool = False
    """No larger size is tried after it (out of memory, the dataset too small)."""
    error: Exception | None = None
    """The step's own error, raised if every size fails so."""


Trial = Callable[[int], StepMeasurement | Skipped]
"""``trial(micro_batch)``: run the step at that size and say what was seen."""


def default_candidates(given: int | None, cap: int | None) -> list[int]:
    """Powers of two up to ``cap`` (2**20 without one), and the loader's own size ``given``."""
    top = cap if cap is not None else 2**20
    sizes, n = [], 1
    while n <= top:
        sizes.append(n)
        n *= 2
    if given is not None and given <= top:
        sizes.append(given)
    return sorted(set(sizes))


def candidate_sizes(
    candidates: Sequence[int] | None,
    given: int | None,
    max_micro_batch: int | None,
    per_rank: int | None,
) -> tuple[list[int], list[int], int | None]:
    """The sizes to try, the candidates left out, and the cap on them.

    A size is tried if it is at most ``max_micro_batch`` and the samples each rank
    contributes per optimizer step (``per_rank``), and divides ``per_rank``.
    """
    caps = [c for c in (max_micro_batch, per_rank) if c is not None]
    cap = min(caps) if caps else None
    sizes = candidates or default_candidates(given, cap)
    sizes = [
        n for n in sizes if (cap is None or n <= cap) and (per_rank is None or per_rank % n == 0)
    ]
    left_out = [n for n in candidates or () if n not in sizes]
    return sizes, left_out, cap


def _predicted_peak(rows: list[dict[str, Any]], micro_batch: int) -> int | None:
    """The peak at ``micro_batch``, on the line through the last two measured peaks."""
    measured = [(r["micro_batch"], r["peak_bytes"]) for r in rows if r["peak_bytes"] is not None]
    if len(measured) < 2:
        return None
    (n1, p1), (n2, p2) = measured[-2:]
    per_sample = max(0.0, (p2 - p1) / (n2 - n1))
    return int(p2 + per_sample * (micro_batch - n2))


def _row(micro_batch: int) -> dict[str, Any]:
    return {"micro_batch": micro_batch, "samples_per_sec": None, "step_ms": None,
            "peak_bytes": None, "fits": False, "skipped": None,
            "confirmed_samples_per_sec": None}  # fmt: skip


def _measured(row: dict[str, Any], measured: StepMeasurement, limit: int | None) -> str | None:
    """Fill ``row`` from a measurement; why no larger size is tried (its peak), else None."""
    n, peak = row["micro_batch"], measured.peak_bytes
    row["step_ms"] = 1e3 * measured.seconds
    row["samples_per_sec"] = n / measured.seconds if measured.seconds > 0 else None
    row["peak_bytes"] = peak
    row["fits"] = limit is None or peak is None or peak <= limit
    if not row["fits"]:
        row["skipped"] = f"peak {peak / GIB:.2f} GiB over the limit {limit / GIB:.2f} GiB"  # type: ignore[operator]
        return str(row["skipped"])
    return None


def walk(
    sizes: Sequence[int],
    limit: int | None,
    trial: Trial,
    agree: Callable[[bool], bool],
) -> tuple[list[dict[str, Any]], list[Exception]]:
    """Try ``sizes`` smallest first; return the table (a row per size seen) and the step errors.

    Before each size, its peak is predicted from the two measured before it; a size
    predicted over ``limit`` is not run, and stops the walk. So does a trial that says
    stop, or a measured peak over ``limit``. With ``agree`` (one call per size, the same
    on every rank), every rank goes on to the next size, or none does.
    """
    table: list[dict[str, Any]] = []
    failures: list[Exception] = []
    stopped: str | None = None  # why this rank tries no larger micro-batch
    for n in sizes:
        row = _row(n)
        predicted = _predicted_peak(table, n)
        if stopped is None and limit is not None and predicted is not None and predicted > limit:
            row["skipped"] = stopped = (
                f"predicted peak {predicted / GIB:.2f} GiB over the limit {limit / GIB:.2f} GiB"
            )
            table.append(row)
        if not agree(stopped is None):  # every rank goes on, or none does
            if stopped is None:
                row["skipped"] = "another rank stopped"
                table.append(row)
            break
        table.append(row)
        outcome = trial(n)
        if isinstance(outcome, Skipped):
            row["skipped"] = outcome.reason
            if outcome.stop:
                stopped = outcome.reason
            if outcome.error is not None:
                failures.append(outcome.error)
            continue
        stopped = _measured(row, outcome, limit)
    return table, failures


def verdict(table: list[dict[str, Any]], agree: Callable[[bool], bool]) -> dict[str, Any] | None:
    """The fastest row (samples/s) among those that fit on every rank; None if none does.

    ``agree`` is called once per row (the same number of calls on every rank): a row
    that fits here but not on another rank is marked so.
    """
    for row in table:  # a size counts only where it fits on every rank (one call each)
        if agree(bool(row["fits"])) or not row["fits"]:
            continue
        row["fits"] = False
        row["skipped"] = "does not fit on another rank"
    fitting = [r for r in table if r["fits"] and r["samples_per_sec"]]
    return max(fitting, key=lambda r: r["samples_per_sec"]) if fitting else None


def _top_two(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This rank's fastest two rows that fit (the first is :func:`verdict`'s on a tie too)."""
    fitting = [r for r in table if r["fits"] and r["samples_per_sec"]]
    return sorted(fitting, key=lambda r: r["samples_per_sec"], reverse=True)[:2]


def confirm(
    table: list[dict[str, Any]],
    best: dict[str, Any] | None,
    trial: Trial,
    agree: Callable[[bool], bool],
    rounds: int = 3,
) -> dict[str, Any] | None:
    """Re-time the winner and the runner-up interleaved; the faster by those medians wins.

    Each size was measured once, one after another, so a busy spell over one size's
    runs and not another's (another process, a CPU's clock) decides the verdict. Here
    the two fastest that fit run ``A B A B ...``, ``rounds`` times each, so load that
    changes over time hits both alike; each row's ``confirmed_samples_per_sec`` is
    its size over the median of its re-timed seconds, and the higher wins (the first
    verdict on a tie). Without a runner-up, with ``rounds`` 0, or if a re-run fails
    (out of memory, the step raised), the first verdict stands.

    ``agree`` keeps ranks in lockstep: one call per row that fits (the pair is the rows
    every rank has in its top two; ranks that disagree on it confirm nothing), one
    before each re-run (every rank runs it, or none does), and one at the end.
    """
    top = _top_two(table)
    pair = [r for r in table if r["fits"] and agree(any(r is t for t in top))]
    if len(pair) != 2 or rounds < 1:
        return best
    seconds: list[list[float]] = [[], []]
    ok = True
    for i in [0, 1] * rounds:  # A B A B ...: both see the same spells of load
        if not agree(ok):
            return best
        outcome = trial(pair[i]["micro_batch"])
        if isinstance(outcome, Skipped):
            ok = False
        else:
            seconds[i].append(outcome.seconds)
    if not agree(ok):
        return best
    for row, times in zip(pair, seconds, strict=True):
        median = statistics.median(times)
        row["confirmed_samples_per_sec"] = row["micro_batch"] / median if median > 0 else None
    return max(pair, key=lambda r: (r["confirmed_samples_per_sec"] or 0.0, r is best))
