"""NumWorkersTuner on an IterableDataset: more than one worker only for a stream that
splits itself among the workers.

A stream copied into two workers that does not split itself yields every sample twice,
and twice as fast: the search took that for a speed-up, chose two workers, and every
later epoch trained on each sample twice. Rates here are injected (the search's choice
is what is tested, not this machine's speed): two workers are the fastest.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_speedkit import tune_num_workers
from lightning_speedkit.data._stream_split import SAMPLES, why_not_split

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


N = 4096


class Shuffled(IterableDataset[torch.Tensor]):
    """4,096 samples in an order of its own, drawn in ``__iter__``: not split by worker.

    ``draw`` says from what: Python's generator (seeded by torch differently in each
    worker), torch's, NumPy's, or one seeded by ``get_worker_info().seed``. ``split``:
    each worker shuffles only its own share (every other sample). So many samples that
    two orders drawn apart seldom meet in their first eight (about one run in 64): only
    the same seeds make them.
    """

    def __init__(self, draw: str, split: bool = False) -> None:
        self.draw, self.split = draw, split

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if self.split and info else (0, 1)
        order = list(range(start, N, step))
        if self.draw == "random":
            random.shuffle(order)
        elif self.draw == "torch":
            order = [order[i] for i in torch.randperm(len(order)).tolist()]
        elif self.draw == "numpy":
            order = [order[i] for i in np.random.permutation(len(order)).tolist()]
        else:  # the seed torch gives this worker, which differs per worker
            random.Random(info.seed if info else 0).shuffle(order)
        return iter(torch.tensor([i]) for i in order)


def _measured(loader: DataLoader[Any]) -> Any:
    return tune_num_workers(loader, max_workers=2, cache=False, progress=False,
                            measure=lambda trial: RATES[trial.num_workers])  # fmt: skip


@pytest.mark.parametrize("draw", ["random", "torch", "numpy", "worker-seed"])
def test_a_stream_each_worker_shuffles_its_own_way_gets_at_most_one_worker(draw: str) -> None:
    """Two workers' first batches differed (each shuffles with its own seed), so the check
    took the stream for split and chose two workers: every sample twice an epoch."""
    with pytest.warns(UserWarning, match=r"gives every worker the whole stream .* only 0 and 1"):
        result = _measured(DataLoader(Shuffled(draw), batch_size=4))
    assert result.best["num_workers"] == 1
    assert max(row["num_workers"] for row in result.table) == 1  # two never tried
    seen = _samples(result.dataloader)
    assert sum(seen.values()) == len(seen) == N  # each sample once


@pytest.mark.parametrize("draw", ["random", "worker-seed"])
def test_a_shuffled_stream_split_by_worker_may_take_two(draw: str) -> None:
    """Worker 0's seeds for both workers make the stream no less split: each worker still
    reads only its own share."""
    result = _measured(DataLoader(Shuffled(draw, split=True), batch_size=4))
    assert result.best["num_workers"] == 2
    assert why_not_split(DataLoader(Shuffled(draw, split=True))) is None


class Ranged(IterableDataset[torch.Tensor]):
    """torch's documented split: a ``worker_init_fn`` narrows each worker's copy."""

    def __init__(self) -> None:
        self.start, self.end = 0, 64

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.tensor([i]) for i in range(self.start, self.end))


def _narrow(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    dataset = info.dataset
    share = (dataset.end - dataset.start) // info.num_workers
    dataset.start, dataset.end = worker_id * share, (worker_id + 1) * share


def test_a_stream_split_by_the_loaders_worker_init_fn_may_take_two() -> None:
    loader = DataLoader(Ranged(), batch_size=8, worker_init_fn=_narrow)
    assert why_not_split(loader) is None
    assert _measured(loader).best["num_workers"] == 2


def test_the_check_reads_a_few_samples_from_each_worker() -> None:
    """Over a stream every worker reads whole, all the first samples of each are shared."""
    why = why_not_split(DataLoader(Stream(split=False)))
    assert why is not None
    assert f"read {SAMPLES} of the same samples among their first {SAMPLES}" in why


class Failing(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Iterator[torch.Tensor]:
        if get_worker_info() is not None:
            raise RuntimeError("cannot open the shards in a worker")
        return iter(torch.tensor([i]) for i in range(64))


def test_a_stream_that_fails_in_workers_is_tuned_without_them() -> None:
    """The check for repeats started two workers outside the search's handling of failing
    candidates: the tuner raised the worker's error. Where it cannot tell, it tries no more
    than one worker, and says why."""
    loader = DataLoader(Failing(), batch_size=8)

    def measure(trial: DataLoader[Any]) -> float:
        if trial.num_workers:
            raise RuntimeError("DataLoader worker (pid 4242) exited unexpectedly")
        return 10.0

    with pytest.warns(UserWarning, match=r"could not tell whether the IterableDataset splits "
                      r".*cannot open the shards in a worker.* only 0 and 1"):  # fmt: skip
        result = tune_num_workers(loader, max_workers=2, cache=False, progress=False,
                                  measure=measure)  # fmt: skip
    assert result.best["num_workers"] == 0
    assert max(row["num_workers"] for row in result.table) == 1
