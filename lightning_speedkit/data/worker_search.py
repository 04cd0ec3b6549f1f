"""tune_num_workers: pick DataLoader worker settings by measuring them.

Candidates run from the loader as given up the worker counts (0, 1, 2, 4, ... up
to the per-rank CPU budget: the cores this process may run on divided by the
local ranks), with ``persistent_workers`` for any worker count and
``pin_memory`` only when CUDA is there to pin for. Each candidate's batches/s is
measured after its workers have started and a few warm-up batches have come
through (start-up is a one-off cost that persistent workers pay once). The
search stops when more workers stop helping, when the time budget is spent, or
at the budget's last count; the best count then tries a deeper prefetch.

Measured alone, one worker is no faster than loading in the training process
(the same single process decodes); its gain is that it loads while the model
trains, so a step costs the longer of the two rather than their sum. So any
worker count beats ``num_workers=0`` unless its hand-off (pickling batches
between processes) makes it deliver less than half the in-process rate; among
worker counts, more must be ``min_gain`` faster to win. That gain is real only
when the model's step takes time of its own, which the loader alone cannot
show: so whatever the search prefers, a setting measured slower than the loader
as given by more than the noise band (``min_gain``) is never chosen, and the
loader as given is kept instead.

Only a measured result is cached: when a candidate failed, the next run measures
again (the dataset may have been fixed in between).

A candidate whose workers crash, hang (past ``timeout``) or cannot receive the
dataset (pickling, under spawn) is skipped with a warning saying why. The
rebuilt loader keeps everything else of the user's: dataset, sampler or batch
sampler (so shuffling, generator, batch size and drop_last), collate_fn,
worker_init_fn, multiprocessing context. The random state that measuring
consumed is restored, so training sees the batches it would have seen.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import math
import os
import platform
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset
from tqdm.auto import tqdm

from lightning_speedkit import _compat, _validation
from lightning_speedkit.data._fork import garbage_kept_from_children
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["TuneResult", "cpu_budget", "rebuild_dataloader", "spare_cores", "tune_num_workers"]

log = logging.getLogger(__name__)

#: Settings the tuner owns; everything else of a loader is kept as it is.
TUNED_KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")
# 3: results chosen against the loader as given, and only measured ones cached (entries
# of version 2 may hold a num_workers=0 that every candidate failing had forced).
_CACHE_VERSION = 3


@dataclass
class TuneResult:
    """What tuning found.

    Attributes:
        best: DataLoader keyword arguments to use (``num_workers``, ``pin_memory``,
            ``persistent_workers``, ``prefetch_factor``).
        table: every candidate tried, with ``batches_per_sec`` (None if skipped)
            and ``skipped`` (the reason, or None).
        best_batches_per_sec: the measured rate of ``best``.
        given_batches_per_sec: the measured rate of the loader as it was given.
        seconds: time spent tuning (0 when the result came from the cache).
        cached: the result was read from the cache rather than measured.
        dataloader: the loader rebuilt with ``best`` (from :func:`tune_num_workers`).
        pending: settings measured faster than ``best`` that the train loader does not
            use yet (set by :class:`~lightning_speedkit.data.NumWorkersTuner` when it
            cannot switch in the middle of an epoch): ``best`` stays the loader in use
            until the next epoch starts with ``pending``. None otherwise.
        pending_reason: why ``pending`` waits for the next epoch.
    """

    best: dict[str, Any]
    table: list[dict[str, Any]]
    best_batches_per_sec: float
    given_batches_per_sec: float | None = None
    seconds: float = 0.0
    cached: bool = False
    dataloader: DataLoader[Any] | None = field(default=None, repr=False)
    pending: dict[str, Any] | None = None
    pending_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("dataloader")
        return data


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


def _settings(loader: DataLoader[Any]) -> dict[str, Any]:
    return {
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "persistent_workers": loader.persistent_workers,
        "prefetch_factor": loader.prefetch_factor if loader.num_workers > 0 else None,
    }


def rebuild_dataloader(
    loader: DataLoader[Any],
    *,
    timeout: float | None = None,
    batch_size: int | None = None,
    **settings: Any,
) -> DataLoader[Any]:
    """A new DataLoader like ``loader`` with the given worker settings changed.

    The sampler (or custom batch sampler) object itself is reused, so the order,
    shuffling, generator, batch size and drop_last are exactly the user's.
    ``timeout`` (seconds a worker may take per batch) is the loader's unless given.
    ``batch_size``, when given, replaces the loader's; a loader batched by a custom
    batch sampler, or not batched by the loader at all, cannot take one.

    A DataLoader subclass (torchdata's ``StatefulDataLoader``, a user's) is built again
    as its own class from the arguments it was made with, as Lightning builds it around
    a distributed sampler, so what it adds (a ``state_dict`` for mid-epoch resume) is
    kept. When those cannot be recovered it is rebuilt as a torch DataLoader, with a
    warning that says what is lost.
    """
    unknown = set(settings) - set(TUNED_KEYS)
    if unknown:
        raise SpeedkitConfigError(
            f"Cannot rebuild a DataLoader with {sorted(unknown)}; only {TUNED_KEYS}."
        )
    # A batch size of its own means the loader made its batch sampler (torch's, or its
    # subclass's own class, as torchdata's StatefulDataLoader does) from it.
    if batch_size is not None and loader.batch_size is None:
        batcher = type(loader.batch_sampler).__name__ if loader.batch_sampler else "the dataset"
        raise SpeedkitConfigError(
            f"`batch_size` cannot be changed to {batch_size} on this DataLoader: its batches "
            f"come from {batcher}, not from a batch size. Set the size there yourself."
        )
    size = loader.batch_size if batch_size is None else batch_size
    kwargs: dict[str, Any] = {
        "dataset": loader.dataset,
        "collate_fn": loader.collate_fn,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "timeout": loader.timeout if timeout is None else timeout,
        "pin_memory_device": loader.pin_memory_device,
        **_settings(loader),
        **settings,
    }
    kwargs.update(_batching(loader, size))
    if _TAKES_IN_ORDER:
        kwargs["in_order"] = getattr(loader, "in_order", True)
    if kwargs["num_workers"] == 0:  # options DataLoader refuses without workers
        kwargs.update(persistent_workers=False, prefetch_factor=None, multiprocessing_context=None,
                      timeout=0)  # fmt: skip
    if kwargs["pin_memory"] and not torch.cuda.is_available():
        kwargs["pin_memory"] = False
    if type(loader) is not DataLoader:
        # A subclass (torchdata's StatefulDataLoader, a user's) is built again from its
        # own arguments, as Lightning builds it around a distributed sampler: what it adds
        # (a state_dict for mid-epoch resume) is kept.
        changes = {key: kwargs[key] for key in (*TUNED_KEYS, "timeout", "multiprocessing_context")
                   if kwargs[key] != getattr(loader, key)}  # fmt: skip
        changes.update(_batching(loader, size))
        again = _compat.dataloader_built_again(loader, changes)
        if again is not None:
            return cast("DataLoader[Any]", again)
        # Its arguments cannot be recovered, or it takes other ones: say what is lost.
        name = type(loader).__name__
        resumable = callable(getattr(loader, "state_dict", None))
        rank_zero_warn(
            f"The train loader, a {name}, cannot be built again from its own arguments (found "
            f"when it is made in a `*_dataloader` hook, else read from its attributes), so it "
            f"is rebuilt as a torch DataLoader with the same dataset, sampler, collate_fn and "
            f"settings; what {name} adds to DataLoader is not kept"
            + (
                ", its `state_dict` included: a run resumed from a mid-epoch checkpoint "
                "starts the epoch's order again (samples seen twice, others not at all). "
                "Make it in the hook, checkpoint at epoch ends, or give the loader the tuned "
                "settings yourself"
                if resumable
                else ". Make it in the hook, build a plain DataLoader, or remove the tuner"
            )
            + "."
        )
    return DataLoader(**kwargs)


_TAKES_IN_ORDER = "in_order" in inspect.signature(DataLoader).parameters  # torch >= 2.6


def _batching(loader: DataLoader[Any], size: int | None) -> dict[str, Any]:
    """The arguments that batch as ``loader`` does, at ``size``: the same sampler or
    batch sampler object, every one spelled out (a subclass's own defaults may differ)."""
    if isinstance(loader.dataset, IterableDataset):
        return {"batch_size": size, "drop_last": loader.drop_last}
    batching: dict[str, Any] = {"sampler": loader.sampler, "batch_sampler": None, "shuffle": False,
                "batch_size": None, "drop_last": False}  # fmt: skip
    if loader.batch_size is not None:
        # Spelled out rather than passed as a batch_sampler, so that Lightning, which reads
        # batch_size and sampler back to inject a DistributedSampler, sees them.
        batching.update(batch_size=size, drop_last=loader.drop_last)
    elif loader.batch_sampler is not None:  # the user's batch sampler object
        batching.update(sampler=None, batch_sampler=loader.batch_sampler, batch_size=1)
    return batching  # else automatic batching off


# --- measuring one candidate -------------------------------------------------------------


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


def _measure(
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


def _describe_failure(exc: BaseException) -> str:
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


# --- the cache ---------------------------------------------------------------------------


def _generators(loader: DataLoader[Any]) -> list[torch.Generator]:
    """The random generators that trial loaders share with ``loader`` and would advance.

    Trial loaders reuse the loader's generator and its sampler objects, so a sampler
    with its own generator (``RandomSampler(ds, generator=g)``) would be drawn from by
    every trial iteration and shuffle the real first epoch differently.
    """
    holders = [loader, loader.sampler, loader.batch_sampler,
               getattr(loader.batch_sampler, "sampler", None)]  # fmt: skip
    found: list[torch.Generator] = []
    for holder in holders:
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def _fingerprint(loader: DataLoader[Any], local_world_size: int, budget: int) -> str:
    dataset = loader.dataset
    custom = getattr(dataset, "fingerprint", None)
    parts = {
        "version": _CACHE_VERSION,
        "dataset": f"{type(dataset).__module__}.{type(dataset).__qualname__}",
        "dataset_fingerprint": custom() if callable(custom) else custom,
        "len": len(dataset) if hasattr(dataset, "__len__") else None,
        "batch_size": loader.batch_size,
        "collate": getattr(loader.collate_fn, "__qualname__", type(loader.collate_fn).__qualname__),
        "machine": platform.node(),
        "cores": cpu_budget(1),
        "local_world_size": local_world_size,
        "worker_budget": budget,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lightning_speedkit/num_workers`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning_speedkit" / "num_workers"


def _read_cache(path: Path) -> TuneResult | None:
    try:
        data = json.loads(path.read_text())
        data.update(cached=True, seconds=0.0)
        result = TuneResult(**data)
    except (OSError, ValueError, TypeError):  # missing or unreadable: measure again
        return None
    if any(row.get("skipped") for row in result.table):  # reached by failures: measure again
        return None
    return result


def _write_cache(path: Path, result: TuneResult) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result.to_json(), indent=2))
        tmp.replace(path)
    except OSError as exc:  # a cache that cannot be written costs a retune, nothing more
        rank_zero_warn(
            f"NumWorkersTuner: could not write its cache at {path} ({exc}); tuning will run again."
        )


# --- the search --------------------------------------------------------------------------

#: The clock the search times its candidates and its ``time_budget`` on (a test can set
#: its own: one that advances by a set time per batch makes every rate an exact figure).
_clock: Callable[[], float] = time.perf_counter


def _worker_counts(budget: int) -> list[int]:
    counts, n = [0], 1
    while n <= budget:
        counts.append(n)
        n *= 2
    if counts[-1] != budget:
        counts.append(budget)
    return counts


def check_tune_arguments(
    *,
    max_workers: int | None = None,
    batches: int = 1,
    warmup_batches: int = 0,
    local_world_size: int = 1,
    min_seconds: float = 0.0,
    min_gain: float = 0.0,
    time_budget: float = 1.0,
    timeout: float = 1.0,
    cache: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    progress: bool = True,
) -> None:
    """Refuse bad tuning arguments, naming the argument (shared by function and callback)."""
    _validation.optional(_validation.non_negative_int, "max_workers", max_workers, example=2)
    _validation.positive_int("batches", batches, example=30)
    _validation.non_negative_int("warmup_batches", warmup_batches, example=3)
    _validation.positive_int("local_world_size", local_world_size, hint="ranks on this machine")
    _validation.non_negative_number("min_seconds", min_seconds, example=0.5, hint="seconds")
    _validation.non_negative_number("min_gain", min_gain, example=0.05, hint="0.05 is 5%")
    _validation.positive_number("time_budget", time_budget, example=120, hint="seconds")
    _validation.positive_number("timeout", timeout, example=30, hint="seconds")
    for name, flag in (("cache", cache), ("force", force), ("progress", progress)):
        _validation.boolean(name, flag)
    _validation.optional(_validation.path, "cache_dir", cache_dir)


def tune_num_workers(
    dataloader: DataLoader[Any],
    *,
    max_workers: int | None = None,
    local_world_size: int = 1,
    batches: int = 30,
    warmup_batches: int = 3,
    min_seconds: float = 0.5,
    min_gain: float = 0.05,
    time_budget: float = 120.0,
    timeout: float = 30.0,
    cache: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    progress: bool = True,
    measure: Callable[[DataLoader[Any]], float] | None = None,
) -> TuneResult:
    """Measure worker settings for ``dataloader`` and return the best, with the rebuilt loader.

    The choice is never a setting measured slower than ``dataloader`` as given by
    more than ``min_gain`` (the noise band): then the loader as given is kept. A
    result is cached only when every candidate was measured; one reached because
    candidates failed (crash, hang, pickling) is measured again next time.

    Args:
        dataloader: the loader to tune; it is not modified.
        max_workers: most workers to try; default the per-rank CPU budget.
        local_world_size: ranks sharing this machine's cores.
        batches: batches timed per candidate (after warm-up). 30 is enough for
            a stable rate when a batch takes milliseconds; raise it for noisy data.
        warmup_batches: batches per candidate left untimed after workers start.
        min_seconds: time each candidate for at least this long, however many
            batches that takes: a longer window evens out a busy machine.
        min_gain: more workers must be this much faster (0.05 = 5%) to count as
            better; the search stops at the first count that is not. Also the
            noise band: a setting this much slower than the loader as given
            loses to it. Raise it (0.1-0.2) on a busy shared machine.
        time_budget: seconds for the whole search; it stops early when spent.
        timeout: seconds a batch may take before a candidate counts as hung.
        cache: read and write results kept per dataset, machine and torch version.
        cache_dir: where (default ``~/.cache/lightning_speedkit/num_workers``).
        force: measure even when a cached result exists (and overwrite it).
        progress: show a progress bar.
        measure: what times one candidate: called with the trial loader (``dataloader``
            rebuilt with the candidate's settings), it returns batches/s, or raises
            if loading fails (the candidate is then skipped with the reason). By
            default, ``batches`` batches after ``warmup_batches`` and worker start-up,
            within ``timeout`` and what is left of ``time_budget``. Pass your own to
            time something else (the batches' copy to the device, say) or to check
            the choice against set figures.

    Example::

        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=8)
        >>> result = tune_num_workers(loader, max_workers=0, batches=2, progress=False, cache=False)
        >>> result.best["num_workers"], len(result.table)
        (0, 1)

        With set figures instead of timings (batches/s by worker count): one worker
        measured 16% slower than the loader as given is not chosen.

        >>> rates = {0: 10.0, 1: 8.4}
        >>> result = tune_num_workers(loader, max_workers=1, cache=False, progress=False,
        ...                           measure=lambda trial: rates[trial.num_workers])
        >>> result.best["num_workers"], result.best_batches_per_sec
        (0, 10.0)
    """
    fix = "pass the loader to tune, e.g. `datamodule.train_dataloader()`"
    _validation.instance("dataloader", dataloader, DataLoader, what="a torch DataLoader", fix=fix)
    check_tune_arguments(
        max_workers=max_workers, batches=batches, warmup_batches=warmup_batches,
        local_world_size=local_world_size, min_seconds=min_seconds, min_gain=min_gain,
        time_budget=time_budget, timeout=timeout, cache=cache, cache_dir=cache_dir,
        force=force, progress=progress,
    )  # fmt: skip

    budget = cpu_budget(local_world_size) if max_workers is None else max_workers
    cache_path = (
        Path(cache_dir or default_cache_dir())
        / f"{_fingerprint(dataloader, local_world_size, budget)}.json"
    )
    if cache and not force:
        cached = _read_cache(cache_path)
        if cached is not None and cached.best.get("num_workers", 0) <= budget:
            cached.dataloader = rebuild_dataloader(dataloader, **cached.best)
            log.info("num_workers: using the cached result %s", cached.best)
            return cached

    torch_state = torch.get_rng_state()
    generators = _generators(dataloader)
    generator_states = [g.get_state() for g in generators]
    pin = torch.cuda.is_available()
    start = _clock()
    table: list[dict[str, Any]] = []

    def timed(trial: DataLoader[Any]) -> float:
        remaining = time_budget - (_clock() - start)
        return _measure(trial, warmup_batches, batches, max(1.0, remaining), timeout, min_seconds,
                        clock=_clock)  # fmt: skip

    def attempt(settings: dict[str, Any]) -> float | None:
        row: dict[str, Any] = {**settings, "batches_per_sec": None, "skipped": None, "given": False}
        table.append(row)
        try:
            rate = (measure or timed)(rebuild_dataloader(dataloader, **settings))
        except Exception as exc:
            row["skipped"] = _describe_failure(exc)
            rank_zero_warn(f"NumWorkersTuner: skipped {settings}: {row['skipped']}.")
            return None
        row["batches_per_sec"] = rate
        return rate

    counts = _worker_counts(budget)
    best: dict[str, Any] = {}  # best with workers
    best_rate = 0.0
    in_process: dict[str, Any] = {}  # num_workers=0
    in_process_rate = 0.0
    given = _settings(dataloader)
    bar = tqdm(total=len(counts) + 1, desc="Tuning DataLoader workers", unit="setting",
               disable=not progress)  # fmt: skip
    try:
        given_rate = attempt(given)
        table[-1]["given"] = True
        bar.update(1)
        for n in counts:
            bar.update(1)
            settings = {
                "num_workers": n,
                "pin_memory": pin,
                "persistent_workers": n > 0,
                "prefetch_factor": 2 if n > 0 else None,
            }
            same_as_given = settings == given or (n == 0 and given["num_workers"] == 0)
            rate = given_rate if same_as_given else attempt(settings)
            bar.set_postfix(num_workers=n, batches_per_sec=f"{rate or 0:.1f}")
            if rate is None:
                pass
            elif n == 0:
                in_process, in_process_rate = settings, rate
            elif rate > best_rate * (1 + min_gain):
                best, best_rate = settings, rate
            elif n >= 2:
                break  # more workers stopped helping
            if _clock() - start > time_budget:
                rank_zero_warn(f"NumWorkersTuner: time budget of {time_budget:.0f} s spent; "
                               f"stopping at num_workers={n}.")  # fmt: skip
                break
        if best and _clock() - start < time_budget:
            deeper = {**best, "prefetch_factor": 4}
            rate = attempt(deeper)
            if rate is not None and rate > best_rate * (1 + min_gain):
                best, best_rate = deeper, rate
        # Workers load while the model trains (a step costs the longer of the two), while
        # loading in the training process adds to every step. So workers win unless their
        # hand-off costs so much that they deliver less than half the in-process rate.
        if in_process and (not best or best_rate < 0.5 * in_process_rate):
            best, best_rate = in_process, in_process_rate
        # That overlap pays only when the model's step takes time of its own, which the
        # loader alone does not show. Measured slower than the loader as given beyond the
        # noise band, a setting would make training slower than doing nothing: keep the
        # loader as given.
        if given_rate is not None and (not best or best_rate * (1 + min_gain) < given_rate):
            if best:
                log.info("num_workers: %s measured %.2fx the loader as given; keeping it as given",
                         best, best_rate / given_rate)  # fmt: skip
            best, best_rate = given, given_rate
    finally:
        bar.close()
        torch.set_rng_state(torch_state)
        for generator, state in zip(generators, generator_states, strict=True):
            generator.set_state(state)

    if not best:
        best = {
            "num_workers": 0,
            "pin_memory": False,
            "persistent_workers": False,
            "prefetch_factor": None,
        }
        rank_zero_warn("NumWorkersTuner: every candidate failed; keeping num_workers=0.")
    result = TuneResult(best, table, best_rate, given_rate, seconds=_clock() - start)
    failed = sum(1 for row in table if row["skipped"])
    if cache and not failed:
        _write_cache(cache_path, result)
    elif cache:
        # A choice that failures forced would outlive their cause (a dataset fixed since).
        rank_zero_info(
            f"NumWorkersTuner: {failed} of {len(table)} candidates failed, so this result is "
            f"not cached; the next run measures again."
        )
    result.dataloader = rebuild_dataloader(dataloader, **best)
    return result
