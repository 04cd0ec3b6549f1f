"""NumWorkersTuner on an IterableDataset: more than one worker only for a stream that
splits itself among the workers.

A stream copied into two workers that does not split itself yields every sample twice,
and twice as fast: the search took that for a speed-up, chose two workers, and every
later epoch trained on each sample twice. Rates here are injected (the search's choice
is what is tested, not this machine's speed): two workers are the fastest.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_speedkit import tune_num_workers

RATES = {0: 10.0, 1: 12.0, 2: 30.0, 3: 45.0}  # batches/s by worker count: more would win


class Stream(IterableDataset[torch.Tensor]):
    """64 samples; ``split``: each worker yields its own share, as the torch docs show."""

    def __init__(self, split: bool) -> None:
        self.split = split

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if self.split and info else (0, 1)
        return iter(torch.tensor([i]) for i in range(start, 64, step))


def _tune(split: bool, num_workers: int = 0) -> Any:
    loader = DataLoader(Stream(split), batch_size=8, num_workers=num_workers)
    return tune_num_workers(loader, max_workers=2, cache=False, progress=False,
                            measure=lambda trial: RATES[trial.num_workers])  # fmt: skip


def _samples(loader: DataLoader[Any]) -> collections.Counter[int]:
    return collections.Counter(int(x) for batch in loader for x in batch.flatten())


def test_a_stream_every_worker_yields_whole_gets_at_most_one_worker() -> None:
    with pytest.warns(UserWarning, match=r"gives every worker the whole stream .* only 0 and 1"):
        result = _tune(split=False)
    assert result.best["num_workers"] == 1
    assert max(row["num_workers"] for row in result.table) == 1  # two never tried
    seen = _samples(result.dataloader)
    assert sum(seen.values()) == len(seen) == 64  # each sample once


def test_a_stream_split_by_worker_may_take_two() -> None:
    result = _tune(split=True)
    assert result.best["num_workers"] == 2
    seen = _samples(result.dataloader)
    assert sum(seen.values()) == len(seen) == 64


def test_a_loader_given_with_workers_over_such_a_stream_is_not_the_pick() -> None:
    """Measured, the loader as given on three workers reads three times as fast: it was kept."""
    with pytest.warns(UserWarning, match=r"gives every worker the whole stream"):
        result = _tune(split=False, num_workers=3)
    assert result.best["num_workers"] <= 1
    seen = _samples(result.dataloader)
    assert sum(seen.values()) == len(seen) == 64


class Failing(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        if get_worker_info() is not None:
            raise RuntimeError("cannot open the shards in a worker")
        return iter(torch.tensor([i]) for i in range(64))


def test_a_stream_that_fails_in_workers_is_tuned_without_them() -> None:
    """The check for repeats started two workers outside the search's handling of failing
    candidates: the tuner raised the worker's error."""
    loader = DataLoader(Failing(), batch_size=8)

    def measure(trial: DataLoader[Any]) -> float:
        if trial.num_workers:
            raise RuntimeError("DataLoader worker (pid 4242) exited unexpectedly")
        return 10.0

    result = tune_num_workers(loader, max_workers=2, cache=False, progress=False, measure=measure)
    assert result.best["num_workers"] == 0
