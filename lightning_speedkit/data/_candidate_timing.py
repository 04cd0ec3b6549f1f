"""Timing one candidate of the worker search: its batches/s after start-up and warm-up,
on a clock the caller gives; a crash, a hang or a dataset that cannot be pickled raises,
and :func:`describe_failure` says which.

Batches made before the clock starts are not timed. A loader with workers keeps
``num_workers * prefetch_factor`` batches asked for ahead of the one it hands out, and
its workers go on making them while the warm-up's batches are read: that many more are
left untimed after the warm-up. (Timed, on a 4-batch epoch, the one batch left after the
warm-up had been made during it, and 2 workers measured 13,000 batches/s where they
could make 166.) What remains is the pipeline at its pace: the few batches in the
workers' hands at either end of the window balance out, and at least ``batches`` timed
keep them small. An epoch that ends first is followed by the next, from a new iterator
over the loader as training starts one (worker start-up again, unless the workers
persist), so a short epoch is timed over as many as it takes. Only a loader that gives
no more batches at all ends the timing early.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from lightning_speedkit import _compat
from lightning_speedkit.data._fork import garbage_kept_from_children
from lightning_speedkit.data.rebuild import rebuild_dataloader


class _TimeoutError(Exception):
    pass


@contextlib.contextmanager
def _main_process_deadline(seconds: float) -> Iterator[None]:
    """A deadline for loading in this process (num_workers=0), where DataLoader has none."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def alarm(signum: int, frame: Any) -> None:
        raise _TimeoutError(f"no batch within {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def queued_ahead(loader: DataLoader[Any]) -> int:
    """Batches ``loader`` may have made before they are asked for: the ``num_workers *
    prefetch_factor`` its iterator keeps asked for ahead; none loading in this process.

    Example::

        >>> from torch.utils.data import DataLoader
        >>> queued_ahead(DataLoader(range(8))), queued_ahead(DataLoader(range(8), num_workers=2))
        (0, 4)
    """
    if loader.num_workers == 0:
        return 0
    return loader.num_workers * (loader.prefetch_factor or 2)


class _Epochs:
    """``loader``'s batches epoch after epoch: a new iterator where one ends, as training
    starts one each epoch."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        self.loader = loader
        self.iterator: Iterator[Any] | None = None
        self.given = 0  # batches read, all epochs together

    def next_batch(self) -> bool:
        """Read one batch; False when a new epoch gives none (the loader has no more)."""
        if self.iterator is not None and self._read(self.iterator):
            return True
        with garbage_kept_from_children():  # workers start here, unless they persist
            self.iterator = iter(self.loader)
        return self._read(self.iterator)

    def _read(self, iterator: Iterator[Any]) -> bool:
        try:
            next(iterator)
        except StopIteration:
            return False
        self.given += 1
        return True


def time_batches(
    next_batch: Callable[[], bool],
    untimed: int,
    batches: int,
    min_seconds: float,
    max_seconds: float,
    clock: Callable[[], float],
) -> tuple[int, float]:
    """``(timed, seconds)``: the batches ``next_batch`` reads after ``untimed`` others, and
    their time on ``clock``, read once before the first timed batch and once after each.

    At least ``batches`` batches and ``min_seconds``, at most ``max_seconds`` (cut at the
    first batch past it); fewer only where ``next_batch`` says there are no more (False).
    """
    for _ in range(untimed):
        if not next_batch():
            return 0, 0.0
    start = clock()
    timed, elapsed = 0, 0.0
    while next_batch():
        timed += 1
        elapsed = clock() - start  # up to the latest batch
        if (timed >= batches and elapsed >= min_seconds) or elapsed > max_seconds:
            break
    return timed, elapsed


def measure_loader(
    loader: DataLoader[Any],
    warmup: int,
    batches: int,
    max_seconds: float,
    timeout: float,
    min_seconds: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Batches/s after start-up, ``warmup`` batches and those made ahead; raises on crash,
    hang, pickling, or a loader that gives no batch to time.

    Leaves :func:`queued_ahead` batches untimed after the warm-up, then times at least
    ``batches`` batches and at least ``min_seconds`` (a longer window evens out a shared
    machine's hiccups), at most ``max_seconds``, on ``clock`` (seconds), epoch after
    epoch where one is shorter (see :func:`time_batches`).
    """
    ahead = queued_ahead(loader)
    if loader.num_workers > 0:
        # Iterate a private copy: with workers, DataLoader raises if one takes longer than
        # `timeout` for a batch. (Iterating the caller's loader itself once left a hung
        # worker's queue locked when the loader was freed.)
        loader = rebuild_dataloader(loader, timeout=timeout)
    epochs = _Epochs(loader)
    with _main_process_deadline(timeout + max_seconds + warmup * timeout):
        finished = False
        try:
            seen, elapsed = time_batches(epochs.next_batch, warmup + ahead, batches,
                                         min_seconds, max_seconds, clock)  # fmt: skip
            finished = True
        finally:
            # After a failure a worker may hang, and the orderly shutdown would wait for it:
            # end the workers first. After a clean run the orderly shutdown comes first: it
            # stops the pin-memory thread before the workers, which, terminated under it,
            # leave it a traceback (ConnectionResetError) for a batch still in flight.
            workers, shutdown = _compat.loader_iterator_workers(epochs.iterator)
            if not finished:
                for worker in workers:
                    if worker.is_alive():
                        worker.terminate()
            if shutdown is not None:
                shutdown()
            epochs.iterator = None
    if seen == 0:
        untimed = (f"the first {warmup + ahead} go untimed ({warmup} of warm-up, {ahead} its "
                   "workers may have made before timing began)" if ahead else
                   f"the first {warmup} are warm-up")  # fmt: skip
        raise RuntimeError(
            f"the loader ran out of batches before one could be timed: it gave {epochs.given}, "
            f"and {untimed}; lower `warmup_batches`, or give a loader that can be iterated again"
        )
    return seen / elapsed


def describe_failure(exc: BaseException, loader: DataLoader[Any] | None = None) -> str:
    """Why a candidate failed, in the table's words: pickling, a hang, a crash, or else.

    A pickling failure names what workers could not receive: of what ``loader`` sends them
    (its dataset, ``collate_fn`` and ``worker_init_fn``), the ``collate_fn`` or the
    ``worker_init_fn`` where it is the one that cannot be pickled, else the dataset.
    """
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    worker = re.match(r"Caught \w+ in (DataLoader worker process \d+)", str(exc))
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if worker is not None and len(lines) > 1:  # a worker's error: its own last line says it
        text = f"{lines[-1]}, in {worker.group(1)}"
    if "pickle" in text.lower() or (
        isinstance(exc, (TypeError, AttributeError)) and "pickl" in str(exc)
    ):
        what = "the dataset" if loader is None else unpicklable_part(loader)
        fix = (
            "each of its attributes must pickle (not a lambda, a local function, an open file)"
            if what == "the dataset"
            else "define it at module level (a lambda or a function defined in another cannot)"
        )
        return (
            f"{what} cannot be sent to worker processes ({text}): workers started by `spawn` "
            f"or `forkserver` get it pickled, so {fix}"
        )
    if isinstance(exc, _TimeoutError) or "timed out" in text.lower():
        return f"workers hung ({text})"
    if "exited unexpectedly" in text or "killed" in text.lower():
        return f"a worker crashed ({text})"
    return f"loading failed ({text})"


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def unpicklable_part(loader: DataLoader[Any]) -> str:
    """Which of what ``loader`` sends its workers cannot be pickled: ``the collate_fn``,
    ``the worker_init_fn``, or else the dataset (not pickled here: it may be large).

    Example::

        >>> unpicklable_part(DataLoader(range(4), collate_fn=lambda batch: batch))
        'the collate_fn (<lambda>)'
        >>> unpicklable_part(DataLoader(range(4)))
        'the dataset'
    """
    for name in ("collate_fn", "worker_init_fn"):
        part = getattr(loader, name, None)
        if part is None:
            continue
        try:
            pickle.Pickler(_Discard()).dump(part)
        except Exception:  # whatever pickling it raises
            label = getattr(part, "__qualname__", type(part).__qualname__)
            return f"the {name} ({label})"
    return "the dataset"
