"""Timing one candidate of the worker search: its batches/s after start-up and warm-up,
on a clock the caller gives; a crash, a hang or a dataset that cannot be pickled raises,
and :func:`describe_failure` says which."""

from __future__ import annotations

import contextlib
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


def measure_loader(
    loader: DataLoader[Any],
    warmup: int,
    batches: int,
    max_seconds: float,
    timeout: float,
    min_seconds: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Batches/s after start-up and ``warmup`` batches; raises on crash, hang or pickling.

    Times at least ``batches`` batches and at least ``min_seconds`` (a longer window
    evens out a shared machine's hiccups), at most ``max_seconds``, on ``clock``
    (seconds), read once before the first timed batch and once after each.
    """
    try:
        per_epoch: int | None = len(loader)
    except TypeError:  # an iterable dataset without a length
        per_epoch = None
    if per_epoch is not None:  # a short epoch: fewer left untimed, at least one timed
        # (with no warm-up left, the timed batch carries the workers' start-up: on such an
        # epoch loading in the training process wins, as it should: workers cannot repay)
        warmup = min(warmup, max(0, per_epoch - 1))
    if loader.num_workers > 0:
        # Iterate a private copy: with workers, DataLoader raises if one takes longer than
        # `timeout` for a batch. (Iterating the caller's loader itself once left a hung
        # worker's queue locked when the loader was freed.)
        loader = rebuild_dataloader(loader, timeout=timeout)
    with _main_process_deadline(timeout + max_seconds + warmup * timeout):
        with garbage_kept_from_children():  # the workers start here
            iterator = iter(loader)
        finished = False
        try:
            seen, elapsed = 0, 0.0
            for _ in range(warmup):
                next(iterator, None)  # includes worker start-up: not timed
            start = clock()
            while True:
                try:
                    next(iterator)
                except StopIteration:
                    break
                seen += 1
                elapsed = clock() - start  # up to the latest batch
                if (seen >= batches and elapsed >= min_seconds) or elapsed > max_seconds:
                    break
            finished = True
        finally:
            # After a failure a worker may hang, and the orderly shutdown would wait for it:
            # end the workers first. After a clean run the orderly shutdown comes first: it
            # stops the pin-memory thread before the workers, which, terminated under it,
            # leave it a traceback (ConnectionResetError) for a batch still in flight.
            workers, shutdown = _compat.loader_iterator_workers(iterator)
            if not finished:
                for worker in workers:
                    if worker.is_alive():
                        worker.terminate()
            if shutdown is not None:
                shutdown()
            del iterator
    if seen == 0:
        raise RuntimeError("the loader ran out of batches during warm-up; lower `warmup_batches`")
    return seen / elapsed


def describe_failure(exc: BaseException) -> str:
    """Why a candidate failed, in the table's words: pickling, a hang, a crash, or else."""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if "pickle" in text.lower() or (
        isinstance(exc, (TypeError, AttributeError)) and "pickl" in str(exc)
    ):
        return f"the dataset cannot be sent to worker processes ({text})"
    if isinstance(exc, _TimeoutError) or "timed out" in text.lower():
        return f"workers hung ({text})"
    if "exited unexpectedly" in text or "killed" in text.lower():
        return f"a worker crashed ({text})"
    return f"loading failed ({text})"
