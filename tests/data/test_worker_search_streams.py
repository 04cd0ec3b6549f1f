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

RATES = {0: 10.0, 1: 12.0, 2: 30.0}  # batches/s by worker count: two workers would win


class Stream(IterableDataset[torch.Tensor]):
    """64 samples; ``split``: each worker yields its own share, as the torch docs show."""

    def __init__(self, split: bool) -> None:
        self.split = split

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if self.split and info else (0, 1)
        return iter(torch.tensor([i]) for i in range(start, 64, step))


def _tune(split: bool) -> Any:
    loader = DataLoader(Stream(split), batch_size=8)
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
