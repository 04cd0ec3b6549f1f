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


def timed_measure(device: torch.device | str, warmup: int = 1, repeats: int = 3) -> Measure:
    """The default measurement: ``warmup`` untimed runs, then the median of ``repeats``.

    The peak memory covers the warm-up too (the first run at a new shape allocates
    most). On CUDA the device is synchronised around each timed run.
    """
    device = torch.device(device)
    peak = PeakMemory(device)

    def measure(run: Callable[[], None], micro_batch: int) -> StepMeasurement:
        peak.reset()
        for _ in range(warmup):
            run()
        times = []
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            times.append(time.perf_counter() - start)
        return StepMeasurement(statistics.median(times), peak.read())

    return measure
