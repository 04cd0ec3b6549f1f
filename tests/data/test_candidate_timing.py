"""Timing one candidate on a clock the test sets: exact rates, the window's bounds, the
batches made ahead left untimed, and the words for each failure."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import pytest
from torch.utils.data import DataLoader, Dataset, IterableDataset, SequentialSampler

from lightning_speedkit.data._candidate_timing import (
    _TimeoutError,
    describe_failure,
    measure_loader,
    queued_ahead,
    time_batches,
)

from .conftest import StepClock

_SPAWNED = ": workers started by `spawn` or `forkserver` get it pickled, so "
_DATASET_FIX = (
    f"{_SPAWNED}each of its attributes must pickle (not a lambda, a local function, an open file)"
)
_FUNCTION_FIX = (
    f"{_SPAWNED}define it at module level (a lambda or a function defined in another cannot)"
)


class _Counting(Dataset[int]):
    """Forty samples; remembers how many were read (in this process: no workers)."""

    def __init__(self) -> None:
        self.read = 0

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> int:
        self.read += 1
        return index


class _Empty(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(())


class _Once(IterableDataset[int]):
    """Two samples, the first time only: a stream that cannot be read again (a worker that
    persists keeps its copy, so its second epoch is empty)."""

    def __init__(self) -> None:
        self.left = [0, 1]

    def __iter__(self) -> Iterator[int]:
        samples, self.left = self.left, []
        return iter(samples)


class _Epochs(SequentialSampler):
    """Counts the epochs started (in this process, where the sampler runs)."""

    def __init__(self, data: Dataset[int]) -> None:
        super().__init__(data)  # type: ignore[arg-type]
        self.started = 0

    def __iter__(self) -> Iterator[int]:
        self.started += 1
        return super().__iter__()


class _MadeAhead:
    """A loader's batches on a virtual clock: ``ready`` batches already made when asked for
    (as a worker's first ones are while another starts up), then one each ``seconds``."""

    def __init__(self, ready: int, seconds: float) -> None:
        self.ready, self.seconds, self.now = ready, seconds, 0.0

    def next_batch(self) -> bool:
        if self.ready:
            self.ready -= 1
        else:
            self.now += self.seconds
        return True

    def clock(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("batches", "min_seconds", "max_seconds", "timed"),
    [
        (4, 0.0, 60.0, 4),  # the batches asked for
        (4, 2.0, 60.0, 8),  # ... or longer: min_seconds (0.25 s a batch) holds it to 8
        (100, 0.0, 1.0, 5),  # ... never past max_seconds: cut at the first batch beyond it
        (25, 0.0, 60.0, 25),  # ... over as many 10-batch epochs as that takes (3)
    ],
)
def test_the_rate_is_the_timed_batches_over_their_time_on_the_clock(
    batches: int, min_seconds: float, max_seconds: float, timed: int
) -> None:
    dataset = _Counting()
    loader = DataLoader(dataset, batch_size=4)  # 10 batches
    rate = measure_loader(loader, warmup=2, batches=batches, max_seconds=max_seconds,
                          timeout=30, min_seconds=min_seconds, clock=StepClock(0.25))  # fmt: skip
    assert rate == 4.0  # one batch every 0.25 s on the clock
    assert dataset.read == (2 + timed) * 4  # the warm-up's batches and the timed ones


@pytest.mark.parametrize(
    ("untimed", "rate"),
    [
        (3 + 4, 4.0),  # warm-up and the batches made ahead untimed: the pipeline's pace
        (3, 20.0),  # the made-ahead ones timed as if made in no time: 5x the pace
    ],
)
def test_batches_made_before_the_clock_started_are_not_timed(untimed: int, rate: float) -> None:
    pipeline = _MadeAhead(ready=3 + 4, seconds=0.25)
    timed, seconds = time_batches(pipeline.next_batch, untimed, batches=5, min_seconds=0.0,
                                  max_seconds=60.0, clock=pipeline.clock)  # fmt: skip
    assert timed == 5
    assert timed / seconds == rate


@pytest.mark.parametrize(
    ("num_workers", "prefetch_factor", "ahead"),
    [(0, None, 0), (1, None, 2), (2, 2, 4), (2, 4, 8)],
)
def test_the_batches_made_ahead_are_the_workers_prefetch(
    num_workers: int, prefetch_factor: int | None, ahead: int
) -> None:
    loader = DataLoader(_Counting(), num_workers=num_workers, prefetch_factor=prefetch_factor)
    assert queued_ahead(loader) == ahead


@pytest.mark.parametrize("persistent_workers", [True, False])
def test_a_short_epoch_with_workers_is_timed_past_its_prefetch_and_over_epochs(
    persistent_workers: bool,
) -> None:
    """The prober's loader: 4 batches an epoch, 2 workers keeping 4 asked for ahead. The
    one batch left to time after 3 of warm-up had been made during the warm-up (13,500
    batches/s measured where 166 could be made); now the 4 made ahead go untimed too and the
    6 timed span the next epochs: 3 + 4 + 6 batches, 4 epochs."""
    dataset = _Counting()
    sampler = _Epochs(list(range(16)))  # type: ignore[arg-type]
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2,
                        persistent_workers=persistent_workers)  # fmt: skip
    clock = StepClock(0.25)
    rate = measure_loader(loader, warmup=3, batches=6, max_seconds=60, timeout=30, clock=clock)
    assert rate == 4.0  # one batch every 0.25 s on the clock
    assert clock.readings == 1 + 6  # read before the first timed batch and after each
    assert sampler.started == 4


@pytest.mark.parametrize(
    ("loader", "message"),
    [
        (DataLoader(_Empty()),
         "the loader ran out of batches before one could be timed: it gave 0, and the first 1 "
         "are warm-up; lower `warmup_batches`, or give a loader that can be iterated again"),
        (DataLoader(_Once(), num_workers=1, persistent_workers=True),
         "the loader ran out of batches before one could be timed: it gave 2, and the first 3 "
         "go untimed (1 of warm-up, 2 its workers may have made before timing began); lower "
         "`warmup_batches`, or give a loader that can be iterated again"),
    ],
    ids=["empty", "made-ahead"],
)  # fmt: skip
def test_a_loader_with_nothing_to_time_says_so(loader: DataLoader[int], message: str) -> None:
    with pytest.raises(RuntimeError) as raised:
        measure_loader(loader, warmup=1, batches=3, max_seconds=10, timeout=10,
                       clock=StepClock(0.25))  # fmt: skip
    assert str(raised.value) == message


@pytest.mark.parametrize(
    ("exc", "words"),
    [
        (pickle.PicklingError("Can't pickle <function <lambda>>"),
         "the dataset cannot be sent to worker processes (PicklingError: Can't pickle "
         f"<function <lambda>>){_DATASET_FIX}"),
        (AttributeError("Can't get local object: cannot pickle 'x'"),
         "the dataset cannot be sent to worker processes (AttributeError: Can't get local "
         f"object: cannot pickle 'x'){_DATASET_FIX}"),
        (_TimeoutError("no batch within 2 s"), "workers hung (_TimeoutError: no batch within 2 s)"),
        (RuntimeError("DataLoader timed out after 2 seconds"),
         "workers hung (RuntimeError: DataLoader timed out after 2 seconds)"),
        (RuntimeError("DataLoader worker (pid 4242) exited unexpectedly\nmore"),
         "a worker crashed (RuntimeError: DataLoader worker (pid 4242) exited unexpectedly)"),
        (ValueError("bad row 7"), "loading failed (ValueError: bad row 7)"),
        (RuntimeError("Caught OSError in DataLoader worker process 1.\nOriginal Traceback "
                      "(most recent call last):\n  File ...\nOSError: no shard at s3://b/0\n"),
         "loading failed (OSError: no shard at s3://b/0, in DataLoader worker process 1)"),
    ],
    ids=["pickling", "pickling-attribute", "deadline", "timeout", "crash", "other", "in-worker"],
)  # fmt: skip
def test_each_failure_is_named_by_its_cause(exc: BaseException, words: str) -> None:
    assert describe_failure(exc) == words


def _module_level(batch: list[int]) -> list[int]:
    return batch


@pytest.mark.parametrize(
    ("loader", "words"),
    [
        (DataLoader(range(8), collate_fn=lambda batch: batch),
         "the collate_fn (<lambda>) cannot be sent to worker processes (PicklingError: Can't "
         f"pickle <function <lambda>>){_FUNCTION_FIX}"),
        (DataLoader(range(8), collate_fn=_module_level, worker_init_fn=lambda worker: None),
         "the worker_init_fn (<lambda>) cannot be sent to worker processes (PicklingError: "
         f"Can't pickle <function <lambda>>){_FUNCTION_FIX}"),
        (DataLoader(range(8), collate_fn=_module_level),
         "the dataset cannot be sent to worker processes (PicklingError: Can't pickle "
         f"<function <lambda>>){_DATASET_FIX}"),
    ],
    ids=["collate_fn", "worker_init_fn", "dataset"],
)  # fmt: skip
def test_a_pickling_failure_names_what_cannot_be_pickled(
    loader: DataLoader[int], words: str
) -> None:
    """Under spawn with a lambda collate_fn the skip blamed the dataset."""
    exc = pickle.PicklingError("Can't pickle <function <lambda>>")
    assert describe_failure(exc, loader) == words
