"""``auto``'s timing: the module's own forward(+backward) against each passing backend.

Each run is timed on the check's inputs, after one warm-up, as the median of a few
repeats; the fastest passing backend is kept and its speedup over the module's own
forward reported. The module's own forward is a candidate too: where it is clearly
faster (:func:`own_is_faster`), ``auto`` keeps it. The clock is an argument, so a test
passes exact times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from lightning_speedkit.attention._parity import Run

Clock = Callable[[], float]
"""Seconds, monotonic (``time.perf_counter``)."""

OWN_FASTER_BELOW = 0.9
"""``auto`` keeps a module's own forward when the fastest passing backend's speedup is
below this, not merely below 1. Each time is the median of three short runs, often on a
shared machine: ratios a few percent either side of 1 are noise, and deciding on them
would flip a module between its own forward and a backend from run to run and from rank
to rank. At 0.9 the own forward was measured more than 10% faster (small attention on a
CPU, where the fused call's overhead outweighs its saving: 0.37x-0.78x measured)."""


def median_seconds(run: Run, *, clock: Clock = time.perf_counter, repeats: int = 3) -> float:
    """Median seconds of ``run``'s forward (+ backward), after one warm-up.

    Example::

        >>> import itertools
        >>> from torch import nn
        >>> linear = nn.Linear(2, 2)
        >>> run = Run(lambda: linear(torch.ones(1, 2)), ((), {}), linear, grad=False)
        >>> ticks = itertools.count()  # each read of the clock one second later
        >>> median_seconds(run, clock=lambda: float(next(ticks)))
        1.0
    """
    device = run.tensors[0].device if run.tensors else torch.device("cpu")
    times = []
    for i in range(repeats + 1):
        _synchronize(device)
        start = clock()
        run.again()
        _synchronize(device)
        if i:
            times.append(clock() - start)
    return statistics.median(times)


def pick_fastest(
    own: Run, passing: Sequence[tuple[str, float, Run]], *, clock: Clock = time.perf_counter
) -> tuple[str, float, float | None]:
    """The fastest of the passing backends, timed against the module's own forward.

    Args:
        own: the module's own forward on the check's inputs.
        passing: ``(backend, parity error, its run)`` for each backend that passed.
        clock: what times the runs.

    Returns:
        The fastest backend (ties: the first by name), its parity error, and its
        speedup (own seconds / its seconds; ``None`` when it took no time).
    """
    own_time = median_seconds(own, clock=clock)
    timed = [(median_seconds(run, clock=clock), backend, error) for backend, error, run in passing]
    best_time, backend, error = min(timed)
    return backend, error, (own_time / best_time if best_time > 0 else None)


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
