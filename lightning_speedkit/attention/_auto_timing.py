"""``auto``'s timing: the module's own forward(+backward) against each passing backend.

Each run is timed on the check's inputs, after one warm-up, as the median of a few
repeats; the fastest passing backend is kept and its speedup over the module's own
forward reported. The clock is an argument, so a test passes exact times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from lightning_speedkit.attention._parity import Run

Clock = Callable[[], float]
"""Seconds, monotonic (``time.perf_counter``)."""


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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # SYNC: timing a check, once per module
