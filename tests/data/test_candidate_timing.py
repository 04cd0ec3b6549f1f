"""Timing one candidate on a clock the test sets: exact rates, the window's bounds, and the
words for each failure."""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import pytest
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_speedkit.data._candidate_timing import (
    _TimeoutError,
    describe_failure,
    measure_loader,
)

from .conftest import StepClock


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


@pytest.mark.parametrize(
    ("batches", "min_seconds", "max_seconds", "timed"),
    [
        (4, 0.0, 60.0, 4),  # the batches asked for
        (4, 2.0, 60.0, 8),  # ... or longer: min_seconds (0.25 s a batch) holds it to 8
        (100, 0.0, 1.0, 5),  # ... never past max_seconds: cut at the first batch beyond it
        (100, 0.0, 60.0, 8),  # ... nor past the epoch: 10 batches, 2 of them warm-up
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


def test_a_loader_with_nothing_to_time_says_so() -> None:
    with pytest.raises(RuntimeError, match="ran out of batches during warm-up"):
        measure_loader(DataLoader(_Empty()), warmup=0, batches=3, max_seconds=10, timeout=10,
                       clock=StepClock(0.25))  # fmt: skip


@pytest.mark.parametrize(
    ("exc", "words"),
    [
        (pickle.PicklingError("Can't pickle <function <lambda>>"),
         "the dataset cannot be sent to worker processes (PicklingError: Can't pickle "
         "<function <lambda>>)"),
        (AttributeError("Can't get local object: cannot pickle 'x'"),
         "the dataset cannot be sent to worker processes (AttributeError: Can't get local "
         "object: cannot pickle 'x')"),
        (_TimeoutError("no batch within 2 s"), "workers hung (_TimeoutError: no batch within 2 s)"),
        (RuntimeError("DataLoader timed out after 2 seconds"),
         "workers hung (RuntimeError: DataLoader timed out after 2 seconds)"),
        (RuntimeError("DataLoader worker (pid 4242) exited unexpectedly\nmore"),
         "a worker crashed (RuntimeError: DataLoader worker (pid 4242) exited unexpectedly)"),
        (ValueError("bad row 7"), "loading failed (ValueError: bad row 7)"),
    ],
    ids=["pickling", "pickling-attribute", "deadline", "timeout", "crash", "other"],
)  # fmt: skip
def test_each_failure_is_named_by_its_cause(exc: BaseException, words: str) -> None:
    assert describe_failure(exc) == words
