"""NumWorkersTuner on an IterableDataset: more than one worker only for a stream that
splits itself among the workers.

A stream copied into two workers that does not split itself yields every sample twice,
and twice as fast: the search took that for a speed-up, chose two workers, and every
later epoch trained on each sample twice. Rates here are injected (the search's choice
is what is tested, not this machine's speed): two workers are the fastest.
"""

from __future__ import annotations

import collections
import io
import itertools
import os
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

from lightning_speedkit import SpeedkitConfigError, tune_num_workers
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


WHOLE = (
    "the IterableDataset gives every worker the whole stream (two workers read the same first "
    "samples in the same order, with their own random seeds as with the same ones), so more "
    "than one worker would repeat every sample"
)
EITHER = (
    "two workers given the same random seeds read {shared} of the same samples among their "
    f"first {SAMPLES}: either the IterableDataset gives every worker the whole stream (in an "
    "order drawn from those seeds), and more than one worker would repeat its samples, or it "
    "draws its samples at random (synthetic data, sampling with replacement), and more would not"
)
CAPPED = (
    "; only 0 and 1 are tried. Split the stream by worker (`torch.utils.data.get_worker_info()`) "
    "to let more workers help; a dataset that splits it already or draws its samples at random "
    "can say so with `speedkit_split_by_worker = True`, and all counts are tried."
)


def _warned(why: str) -> str:
    return re.escape(f"NumWorkersTuner: {why}{CAPPED}")


def test_a_stream_every_worker_yields_whole_gets_at_most_one_worker() -> None:
    with pytest.warns(UserWarning, match=_warned(WHOLE)):
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
    took the stream for split and chose two workers: every sample twice an epoch. With their
    own seeds they read different samples, as random draws would: the reason says either."""
    with pytest.warns(UserWarning, match=_warned(EITHER.format(shared=SAMPLES))):
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
    assert why_not_split(DataLoader(Stream(split=False))) == WHOLE
    assert why_not_split(DataLoader(Shuffled("random"))) == EITHER.format(shared=SAMPLES)


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
        elif source == "pipe":  # a file that cannot seek: read once
            read, write = os.pipe()
            os.write(write, "".join(f"{i}\n" for i in range(64)).encode())
            os.close(write)
            self.src = os.fdopen(read)
        elif source == "bytes":  # in memory, read on where the last iterator stopped
            self.src = io.StringIO("".join(f"{i}\n" for i in range(64)))
        elif source == "file":  # on disk: forked workers would share its offset too
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
     ("pipe", "`src`, an open file (TextIOWrapper)"),
     ("queue", "`src`, a queue (Queue)"),
     ("nested", "`reader.rows`, an iterator (range_iterator)")],
    ids=["iterator", "generator", "file", "pipe", "queue", "nested"],
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


class Drawn(IterableDataset[torch.Tensor]):
    """64 samples drawn at random each epoch: ``torch.randn`` (synthetic data) or picked with
    replacement from a million. Under each worker's own seeds no two workers draw the same,
    so more workers repeat nothing; under the same seeds they draw alike."""

    def __init__(self, draw: str) -> None:
        self.draw = draw

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(64):
            if self.draw == "randn":
                yield torch.randn(4)
            else:
                yield torch.tensor([random.randrange(10**6)])


class SaidSplit(Drawn):
    speedkit_split_by_worker = True


@pytest.mark.parametrize("draw", ["randn", "with-replacement"])
def test_a_stream_of_random_draws_is_capped_with_an_honest_reason(draw: str) -> None:
    """The reason said the stream would repeat every sample: it repeats none. It may be
    either, and it says so, and how to say which."""
    with pytest.warns(UserWarning, match=_warned(EITHER.format(shared=SAMPLES))):
        result = _measured(DataLoader(Drawn(draw), batch_size=4))
    assert [row["num_workers"] for row in result.table] == [0, 1, 1]  # then 1, prefetch 4


@pytest.mark.parametrize("draw", ["randn", "with-replacement"])
def test_a_stream_that_says_it_may_use_more_workers_is_not_checked(
    draw: str, recwarn: pytest.WarningsRecorder
) -> None:
    result = _measured(DataLoader(SaidSplit(draw), batch_size=4))
    assert [row["num_workers"] for row in result.table] == [0, 1, 2, 2]  # then prefetch 4
    assert result.best["num_workers"] == 2
    assert [str(w.message) for w in recwarn if "only 0 and 1" in str(w.message)] == []
    assert why_not_split(DataLoader(SaidSplit(draw))) is None


def test_a_dataset_that_says_so_must_say_it_with_a_bool() -> None:
    dataset = Drawn("randn")
    dataset.speedkit_split_by_worker = "yes"  # type: ignore[attr-defined]
    with pytest.raises(SpeedkitConfigError, match=r"`speedkit_split_by_worker` must be True"):
        why_not_split(DataLoader(dataset))


class Padded(IterableDataset[torch.Tensor]):
    """64 samples split by worker (every other one each); the first two are the same padding
    sample, so the two workers' first samples share one value, and only that one."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if info else (0, 1)
        return iter(torch.tensor([-1 if i < 2 else i]) for i in range(start, 64, step))


def test_a_split_stream_whose_workers_share_one_value_may_take_two() -> None:
    """One padding sample (or small label) in both workers' first eight was taken for a
    stream every worker reads whole: the tuner kept one worker, and warned it would repeat."""
    assert why_not_split(DataLoader(Padded())) is None
    assert _measured(DataLoader(Padded(), batch_size=4)).best["num_workers"] == 2


class Rewound(IterableDataset[torch.Tensor]):
    """64 samples from a file object held from ``__init__``, which ``__iter__`` rewinds."""

    def __init__(self, file: Any) -> None:
        self.file = file

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.file.seek(0)
        return (torch.tensor([int(line)]) for line in self.file.read().split())


class Endless(IterableDataset[torch.Tensor]):
    def __init__(self, ids: Iterator[int]) -> None:
        self.ids = ids

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (torch.tensor([next(self.ids)]) for _ in range(64))


def test_an_in_memory_file_or_an_endless_iterator_is_not_a_source_used_up(
    tmp_path: Path,
) -> None:
    """An in-memory file that ``__iter__`` rewinds, and an ``itertools.count``, left the loader
    untuned: neither runs out. A generator, a pipe and a file on disk (whose offset forked
    workers share) still do."""
    lines = "".join(f"{i}\n" for i in range(64)).encode()
    assert held_source(Rewound(io.BytesIO(lines))) is None
    for endless in (itertools.count(), itertools.cycle([1, 2]), itertools.repeat(1)):
        assert held_source(Endless(endless)) is None
    assert held_source(Endless(itertools.repeat(1, 64))) == "`ids`, an iterator (repeat)"
    assert held_source(Endless(i for i in range(64))) == "`ids`, a generator"
    (tmp_path / "lines.txt").write_bytes(lines)
    with open(tmp_path / "lines.txt", "rb") as on_disk:
        assert held_source(Rewound(on_disk)) == "`file`, an open file (BufferedReader)"
    read, write = os.pipe()
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        assert held_source(Rewound(pipe)) == "`file`, an open file (BufferedReader)"


def test_an_in_memory_file_read_on_where_it_stopped_is_put_back(
    tmp_path: Path, paced: Callable[[Rates], Figures]
) -> None:
    """An in-memory file the dataset reads on where the last iterator stopped is tuned: each
    read (the split check's, each trial's) is put back where it was, so every trial reads
    all of it, and then so does training."""
    paced({0: 10.0, 1: 12.0, 2: 30.0})
    loader = DataLoader(OneShot("bytes", tmp_path), batch_size=8)
    with pytest.warns(UserWarning, match=_warned(WHOLE)):
        result = tune_num_workers(loader, max_workers=2, cache=False, progress=False, batches=2,
                                  warmup_batches=0, min_seconds=0.0)  # fmt: skip
    assert result.untuned is None
    rates = [(row["num_workers"], row["prefetch_factor"], row["batches_per_sec"])
             for row in result.table]  # fmt: skip
    expected = [(0, None, 10.0), (1, 2, 12.0), (1, 4, 12.0)]  # each measured: none ran out
    assert rates == [(n, p, pytest.approx(r)) for n, p, r in expected]
    seen = _samples(loader)
    assert sum(seen.values()) == len(seen) == 64  # training gets every sample
