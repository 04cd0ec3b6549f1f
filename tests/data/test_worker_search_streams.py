"""NumWorkersTuner on an IterableDataset: more than one worker only for a stream that
splits itself among the workers.

A stream copied into two workers that does not split itself yields every sample twice,
and twice as fast: the search took that for a speed-up, chose two workers, and every
later epoch trained on each sample twice. Rates here are injected (the search's choice
is what is tested, not this machine's speed): two workers are the fastest.
"""

from __future__ import annotations

import collections
import queue
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_speedkit import tune_num_workers
from lightning_speedkit.data._stream_split import SAMPLES, held_source, why_not_split

from .conftest import Figures, Rates

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


class OneShot(IterableDataset[torch.Tensor]):
    """64 samples from a source opened once, in ``__init__``: each iterator goes on where
    the last stopped. ``source`` picks which kind, held where ``holder`` says."""

    def __init__(self, source: str, tmp_path: Path) -> None:
        if source == "iterator":
            self.src: Any = iter(range(64))
        elif source == "generator":
            self.src = (i for i in range(64))
        elif source == "file":
            (tmp_path / "lines.txt").write_text("".join(f"{i}\n" for i in range(64)))
            self.src = open(tmp_path / "lines.txt")  # noqa: SIM115 - held open, as such code does
        elif source == "queue":
            self.src = queue.Queue()
            for i in range(64):
                self.src.put(i)
            self.src.put(None)
        else:  # an iterator inside an object of the user's
            self.reader = OneShotReader(iter(range(64)))

    def __iter__(self) -> Iterator[torch.Tensor]:
        source = self.reader.rows if hasattr(self, "reader") else self.src
        if isinstance(source, queue.Queue):
            source = iter(source.get, None)
        return (torch.tensor([int(i)]) for i in source)


class OneShotReader:
    def __init__(self, rows: Iterator[int]) -> None:
        self.rows = rows


@pytest.mark.parametrize(
    ("source", "where"),
    [("iterator", "`src`, an iterator (range_iterator)"),
     ("generator", "`src`, a generator"),
     ("file", "`src`, an open file (TextIOWrapper)"),
     ("queue", "`src`, a queue (Queue)"),
     ("nested", "`reader.rows`, an iterator (range_iterator)")],
    ids=["iterator", "generator", "file", "queue", "nested"],
)  # fmt: skip
def test_a_stream_from_a_source_opened_once_is_left_untuned(
    source: str, where: str, tmp_path: Path, paced: Callable[[Rates], Figures]
) -> None:
    """The trials read the dataset itself before training: in-process they used up the
    stream, and training got none of it, without a word."""
    figures = paced({0: 10.0, 1: 12.0, 2: 30.0})
    dataset = OneShot(source, tmp_path)
    loader = DataLoader(dataset, batch_size=8)
    match = rf"reads from {re.escape(where)}, which reading uses up: .* left as given, untuned"
    with pytest.warns(UserWarning, match=match):
        result = tune_num_workers(loader, max_workers=2, cache_dir=tmp_path / "cache",
                                  progress=False)  # fmt: skip
    assert figures.seen == []  # nothing measured
    assert (result.table, result.best_batches_per_sec) == ([], 0.0)
    assert result.untuned is not None
    assert where in result.untuned
    assert result.dataloader is loader
    assert not (tmp_path / "cache").exists()  # nothing cached
    seen = _samples(loader)
    assert sum(seen.values()) == len(seen) == 64  # training gets every sample


def test_a_stream_whose_source_restarts_is_tuned() -> None:
    assert held_source(Stream(split=False)) is None
    assert held_source(Shuffled("random")) is None
    assert held_source(Ranged()) is None


_GLOBAL: dict[str, Iterator[int]] = {}


class FromGlobal(IterableDataset[torch.Tensor]):
    """A one-shot source no attribute shows: a module's global."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (torch.tensor([i]) for i in _GLOBAL["rows"])


def test_a_stream_the_trials_used_up_is_said_and_not_cached(
    tmp_path: Path, paced: Callable[[Rates], Figures]
) -> None:
    paced({0: 10.0, 1: 12.0, 2: 30.0})
    _GLOBAL["rows"] = iter(range(64))
    loader = DataLoader(FromGlobal(), batch_size=8)
    said = r"gives no sample after the trials, which read batches from it: .* used it up"
    with pytest.warns(UserWarning, match=said):
        tune_num_workers(loader, max_workers=2, cache_dir=tmp_path, progress=False)
    assert list(tmp_path.glob("*.json")) == []  # a measure of a stream used up is not kept
    assert _samples(loader) == collections.Counter()
