"""One micro-batch's training step, timed: seconds per run and the peak memory it reached."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_speedkit.compute._memory_probe import PeakMemory

__all__ = ["Measure", "StepMeasurement", "timed_measure"]


@dataclass(frozen=True)
class StepMeasurement:
    """One candidate's training step, as measured."""

    seconds: float
    """Forward and backward of one micro-batch (median of the timed runs)."""
    peak_bytes: int | None = None
    """Peak memory while it ran (device allocator on CUDA, resident set on CPU); None: unknown."""


Measure = Callable[[Callable[[], None], int], StepMeasurement]
"""``measure(run, micro_batch)``: run the step as often as it likes and say what it saw."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # SYNC: tuning only, before training, to time the step


def timed_measure(
    device: torch.device | str,
    warmup: int = 1,
    repeats: int = 3,
    *,
    min_seconds: float = 0.02,
    max_runs: int = 200,
    clock: Callable[[], float] | None = None,
) -> Measure:
    """The default measurement: ``warmup`` untimed runs, then the median of the timed runs.

    At least ``repeats`` runs are timed, and more until they add up to ``min_seconds``
    of timed time, but never more than ``max_runs`` (nor fewer than ``repeats``): a
    step of a fraction of a millisecond is a few ticks of the clock and easily hit by
    a stray interruption, so it is timed over many runs (0.3 ms: about 67), while a
    step of 7 ms or more runs just ``repeats`` times. The peak memory covers the
    warm-up too (the first run at a new shape allocates most). On CUDA the device is
    synchronised around each timed run.

    Args:
        device: where the step runs (its memory is read, and CUDA is synchronised).
        warmup: untimed runs first (the first run at a shape allocates, picks kernels).
        repeats: the fewest timed runs.
        min_seconds: timed runs go on until their times add up to this; 0 stops at
            ``repeats``.
        max_runs: the most timed runs, however short the step.
        clock: seconds, monotonic; default :func:`time.perf_counter` (tests pass a fake).
    """
    device = torch.device(device)
    peak = PeakMemory(device)
    most = max(repeats, max_runs)
    now = clock if clock is not None else time.perf_counter

    def measure(run: Callable[[], None], micro_batch: int) -> StepMeasurement:
        peak.reset()
        for _ in range(warmup):
            run()
        times: list[float] = []
        while len(times) < repeats or (sum(times) < min_seconds and len(times) < most):
            _sync(device)
            start = now()
            run()
            _sync(device)
            times.append(now() - start)
        return StepMeasurement(statistics.median(times), peak.read())

    return measure
