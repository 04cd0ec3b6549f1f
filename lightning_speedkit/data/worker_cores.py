"""Cores for loader workers: this rank's share of the machine, and the ones the training
compute leaves idle when data loading holds it back."""

from __future__ import annotations

import math
import os

__all__ = ["cpu_budget", "spare_cores"]


def cpu_budget(local_world_size: int = 1) -> int:
    """Cores this process may use, shared among the ranks on this machine (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


def spare_cores(
    cores: int,
    compute_threads: int,
    model_batches_per_sec: float,
    process_batches_per_sec: float,
) -> int:
    """Cores the training compute leaves idle when data loading holds it back, for workers.

    Run back to back, the compute consumes ``model_batches_per_sec`` on
    ``compute_threads`` cores. Fed at a pace R it computes a share R / model rate of
    the time, so it needs ``compute_threads * R / model_batches_per_sec`` cores. R is
    at most what the model consumes and at most what ``cores`` loading processes
    deliver at ``process_batches_per_sec`` each (one process's rate: the loader's rate
    over its workers, or its rate with none). The other cores, to the nearest whole
    core, are the ones the compute does not need.

    Args:
        cores: this rank's cores (:func:`cpu_budget`).
        compute_threads: torch's threads for the model (``torch.get_num_threads()``).
        model_batches_per_sec: the rate the model consumes batches at when it never
            waits for data.
        process_batches_per_sec: the rate one loading process delivers batches at.

    Example::

        >>> spare_cores(2, 2, model_batches_per_sec=731.0, process_batches_per_sec=10.3)
        2
        >>> spare_cores(2, 2, model_batches_per_sec=34.0, process_batches_per_sec=94.0)
        0
    """
    if model_batches_per_sec <= 0 or process_batches_per_sec <= 0:
        return 0
    threads = min(max(1, compute_threads), cores)
    pace = min(model_batches_per_sec, cores * process_batches_per_sec)
    needed = threads * pace / model_batches_per_sec
    return max(0, cores - math.floor(needed + 0.5))
