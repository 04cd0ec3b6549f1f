"""``auto``'s timing: the module's own forward(+backward) against each passing backend.

The runs are timed on the check's inputs in turns (own, then each backend, round after
round, after one warm-up each), and compared in pairs within a round: a busy spell of a
shared machine slows a round's runs alike, and the median of the rounds' ratios leaves
out a round it fell on unevenly. The first passing backend (``sdpa``: PyTorch's own
choice of kernel) is kept unless another was clearly faster (:data:`SWITCH_BELOW`), so
near-equal backends, whose numerics differ in the last bits, do not trade places from
run to run. Its speedup over the module's own
forward is reported, and the own forward is a candidate too: where it is clearly faster
(:func:`own_is_faster`), ``auto`` keeps it. The clock is an argument, so a test passes
exact times.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from lightning_speedkit.attention._parity import Run

Clock = Callable[[], float]
"""Seconds, monotonic (``time.perf_counter``)."""

OWN_FASTER_BELOW = 0.9
"""``auto`` keeps a module's own forward when the fastest passing backend's speedup is
below this, not merely below 1. Each time is the median of a few short runs, often on a
shared machine: ratios a few percent either side of 1 are noise, and deciding on them
would flip a module between its own forward and a backend from run to run and from rank
to rank. At 0.9 the own forward was measured more than 10% faster (small attention on a
CPU, where the fused call's overhead outweighs its saving: 0.37x-0.78x measured)."""


SWITCH_BELOW = 0.9
"""A later passing backend replaces the first (``sdpa``) only when it ran in less than this
share of its time, as the median over rounds of their paired times. Backends within 10%
of each other are one as far as a few short timed runs can tell, and picking among them
by noise gave seeded runs other backends, and so other last bits of their losses, from
one run to the next."""


def interleaved_times(
    runs: Sequence[Run],
    *,
    clock: Clock = time.perf_counter,
    rounds: int = 5,
    min_seconds: float = 0.01,
    max_rounds: int = 25,
) -> list[list[float]]:
    """Seconds of each of ``runs``' forward (+ backward), timed in turns: one list per run,
    one time per round.

    One warm-up each, then rounds of one timed run of each, in order: at least ``rounds``,
    and more until each run's timed total reaches ``min_seconds`` (a call of a few hundred
    microseconds is timed more often), at most ``max_rounds``. The runs of one round are
    neighbours in time, so a machine's load changes them alike: compare them in pairs.

    Example::

        >>> import itertools
        >>> from torch import nn
        >>> linear = nn.Linear(2, 2)
        >>> run = Run(lambda: linear(torch.ones(1, 2)), ((), {}), linear, grad=False)
        >>> ticks = itertools.count()  # each read of the clock one second later
        >>> interleaved_times([run, run], clock=lambda: float(next(ticks)))
        [[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0]]
    """
    device = next((r.tensors[0].device for r in runs if r.tensors), torch.device("cpu"))
    times: list[list[float]] = [[] for _ in runs]
    for round_ in range(max_rounds + 1):
        for run, taken in zip(runs, times, strict=True):
            _synchronize(device)
            start = clock()
            run.again()
            _synchronize(device)
            if round_:  # round 0 warms up
                taken.append(clock() - start)
        if round_ >= rounds and all(sum(taken) >= min_seconds for taken in times):
            break
    return times


def paired_ratio(these: Sequence[float], those: Sequence[float]) -> float | None:
    """The median over rounds of ``these / those`` (None where ``those`` took no time).

    Example::

        >>> paired_ratio([2.0, 9.0, 2.2], [1.0, 4.5, 1.0])  # round 2 ran under load
        2.0
    """
    ratios = [a / b for a, b in zip(these, those, strict=True) if b > 0]
    return statistics.median(ratios) if ratios else None


def pick_fastest(
    own: Run, passing: Sequence[tuple[str, float, Run]], *, clock: Clock = time.perf_counter
) -> tuple[str, float, float | None]:
    """The passing backend to run, timed against the module's own forward.

    Args:
        own: the module's own forward on the check's inputs.
        passing: ``(backend, parity error, its run)`` for each backend that passed, in
            :func:`~lightning_speedkit.attention.backends.auto_candidates`' order.
        clock: what times the runs.

    Returns:
        The first passing backend, or the one that ran in the least share of its time
        where that share (:func:`paired_ratio`) is below :data:`SWITCH_BELOW`; its parity
        error; and its speedup (own seconds / its seconds, paired; ``None`` when it took
        no time).
    """
    own_times, *times = interleaved_times([own, *(run for _, _, run in passing)], clock=clock)
    shares = [paired_ratio(t, times[0]) for t in times]
    known = [math.inf if share is None else share for share in shares]  # the first took none
    fastest = min(range(len(known)), key=known.__getitem__)
    chosen = fastest if known[fastest] < SWITCH_BELOW else 0
    backend, error, _ = passing[chosen]
    return backend, error, paired_ratio(own_times, times[chosen])


def own_is_faster(speedup: float | None) -> bool:
    """Whether the module's own forward beat the fastest passing backend by the margin.

    Args:
        speedup: own seconds / the fastest backend's seconds (:func:`pick_fastest`);
            ``None`` (the backend took no time) is a backend that won.

    Example::

        >>> own_is_faster(0.73), own_is_faster(0.95), own_is_faster(None)
        (True, False, False)
    """
    return speedup is not None and speedup < OWN_FASTER_BELOW


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # SYNC: timing a check, once per module
