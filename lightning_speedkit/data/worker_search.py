"""tune_num_workers: pick DataLoader worker settings by measuring them.

Candidates run from the loader as given up the worker counts (0, 1, 2, 4, ... up
to the per-rank CPU budget: the cores this process may run on divided by the
local ranks), with ``persistent_workers`` for any worker count and
``pin_memory`` only when CUDA is there to pin for. Each candidate's batches/s is
measured after its workers have started and a few warm-up batches have come
through (start-up is a one-off cost that persistent workers pay once), leaving
out too the ``num_workers * prefetch_factor`` batches the workers may have made
ahead meanwhile, over as many epochs as the timing takes where one is short. The
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

An ``IterableDataset`` that reads from a source opened once (an iterator, a generator, an
open file, a socket, a queue held by the dataset) is not measured at all: every trial
would take samples from training. The loader is left as given, with a warning naming the
attribute (``TuneResult.untuned`` says why). A source held where the attributes do not
show it (a module's global) is found only when the trials use it up: a fresh iterator
gives nothing after them, and a warning says so. An in-memory file the dataset holds
(``io.BytesIO``) is put back where it was after each trial, whether ``__iter__`` rewinds
it or not: each trial, and then training, reads it from there.

A candidate whose workers crash, hang (past ``timeout``) or cannot receive the dataset,
``collate_fn`` or ``worker_init_fn`` (pickling, under spawn) is skipped with a warning
saying why (and which of them). The
rebuilt loader keeps everything else of the user's (see
:func:`~lightning_speedkit.data.rebuild.rebuild_dataloader`). The random state that
measuring consumed is restored, so training sees the batches it would have seen.

This module runs the search; its parts live beside it: the grid and the pick among
measured rates in ``_candidates.py``, the timing of one candidate in
``_candidate_timing.py``, the cache in ``_result_cache.py``, the rebuilt loader in
``rebuild.py``, the cores in ``worker_cores.py``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset
from tqdm.auto import tqdm

from lightning_speedkit import _validation
from lightning_speedkit._random import loader_generators, random_state_kept
from lightning_speedkit.data import _candidates, _result_cache
from lightning_speedkit.data._candidate_timing import describe_failure
from lightning_speedkit.data._candidate_timing import measure_loader as _measure
from lightning_speedkit.data._result_cache import default_cache_dir
from lightning_speedkit.data._stream_split import held_source, kept_positions, why_not_split
from lightning_speedkit.data.rebuild import _settings, rebuild_dataloader
from lightning_speedkit.data.tune_result import TuneResult
from lightning_speedkit.data.worker_cores import cpu_budget, spare_cores

__all__ = ["TuneResult", "cpu_budget", "rebuild_dataloader", "spare_cores", "tune_num_workers"]

log = logging.getLogger(__name__)

#: The clock the search times its candidates and its ``time_budget`` on (a test can set
#: its own: one that advances by a set time per batch makes every rate an exact figure).
#: Timing one candidate is :func:`_measure` here, so a test can set its own too.
_clock: Callable[[], float] = time.perf_counter

Measure = Callable[[DataLoader[Any]], float]


def _check_worker_arguments(
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


def _attempt(
    table: list[dict[str, Any]], loader: DataLoader[Any], settings: dict[str, Any], measure: Measure
) -> float | None:
    """Measure ``loader`` rebuilt with ``settings``, adding the row to ``table``: the rate,
    or None when loading failed (the row and a warning say why)."""
    row: dict[str, Any] = {**settings, "batches_per_sec": None, "skipped": None, "given": False}
    table.append(row)
    try:
        with kept_positions(loader.dataset):  # each trial reads in-memory files from there
            rate = measure(rebuild_dataloader(loader, **settings))
    except Exception as exc:
        row["skipped"] = describe_failure(exc, loader)
        rank_zero_warn(f"NumWorkersTuner: skipped {settings}: {row['skipped']}.")
        return None
    row["batches_per_sec"] = rate
    return rate


def _search(
    loader: DataLoader[Any],
    budget: int,
    measure: Measure,
    *,
    min_gain: float,
    time_budget: float,
    timeout: float,
    start: float,
    progress: bool,
) -> tuple[list[dict[str, Any]], dict[str, Any], float, float | None]:
    """Measure the loader as given, then the grid up from no workers, and pick.

    The grid stops when a count from 2 on is not ``min_gain`` faster than the best so far
    (more workers stopped helping) or when ``time_budget`` since ``start`` is spent; the
    best count then tries a deeper prefetch if time is left. Returns the table of every
    candidate, the pick (empty when nothing was measured) and its rate, and the rate of
    the loader as given (None if it failed).
    """
    table: list[dict[str, Any]] = []
    given = _settings(loader)
    not_split = None
    if budget >= 2 or given["num_workers"] >= 2:
        not_split = why_not_split(loader, timeout)
    if not_split is not None:
        rank_zero_warn(
            f"NumWorkersTuner: {not_split}; only 0 and 1 are tried. Split the stream by worker "
            "(`torch.utils.data.get_worker_info()`) to let more workers help; a dataset that "
            "splits it already or draws its samples at random can say so with "
            "`speedkit_split_by_worker = True`, and all counts are tried."
        )
        budget = min(budget, 1)
    counts = _candidates.worker_counts(budget)
    pin = torch.cuda.is_available()
    best: dict[str, Any] = {}  # best with workers
    best_rate = 0.0
    in_process: dict[str, Any] = {}  # num_workers=0
    in_process_rate = 0.0
    bar = tqdm(total=len(counts) + 1, desc="Tuning DataLoader workers", unit="setting",
               disable=not progress)  # fmt: skip
    try:
        given_rate = _attempt(table, loader, given, measure)
        table[-1]["given"] = True
        bar.update(1)
        for n in counts:
            bar.update(1)
            settings = _candidates.candidate(n, pin)
            same_as_given = settings == given or (n == 0 and given["num_workers"] == 0)
            rate = given_rate if same_as_given else _attempt(table, loader, settings, measure)
            bar.set_postfix(num_workers=n, batches_per_sec=f"{rate or 0:.1f}")
            if rate is None:
                pass
            elif n == 0:
                in_process, in_process_rate = settings, rate
            elif _candidates.beats(rate, best_rate, min_gain):
                best, best_rate = settings, rate
            elif n >= 2:
                break  # more workers stopped helping
            if _clock() - start > time_budget:
                rank_zero_warn(f"NumWorkersTuner: time budget of {time_budget:.0f} s spent; "
                               f"stopping at num_workers={n}.")  # fmt: skip
                break
        if best and _clock() - start < time_budget:
            deeper = {**best, "prefetch_factor": 4}
            rate = _attempt(table, loader, deeper, measure)
            if rate is not None and _candidates.beats(rate, best_rate, min_gain):
                best, best_rate = deeper, rate
    finally:
        bar.close()
    # The loader as given, on two workers or more, may repeat every sample: never the pick.
    as_given = None if not_split is not None and given["num_workers"] >= 2 else given_rate
    best, best_rate = _candidates.choose(
        (given, as_given), (in_process, in_process_rate), (best, best_rate), min_gain
    )
    return table, best, best_rate, given_rate


def _left_as_given(loader: DataLoader[Any], held: str) -> TuneResult:
    """``loader`` untuned, as given, because its ``IterableDataset`` reads from ``held``, a
    source reading uses up: every trial would take samples from training."""
    why = (
        f"the IterableDataset reads from {held}, which reading uses up: a trial would take "
        "its samples from training (a fresh `iter()` of the dataset goes on where the last "
        "stopped), so the loader is left as given, untuned. Open the source in `__iter__`, "
        "so that each iterator reads the stream from its start, to let it be tuned"
    )
    rank_zero_warn(f"NumWorkersTuner: {why}.")
    result = TuneResult(_settings(loader), [], 0.0, untuned=why)
    result.dataloader = loader
    return result


def _used_up(loader: DataLoader[Any], table: list[dict[str, Any]]) -> bool:
    """Whether trials in this process read batches from ``loader``'s ``IterableDataset``
    and a fresh iterator of it now gives none: a stream that goes on where the last
    iterator stopped, used up by the trials (and said so).

    To find out, it takes one sample in this process (``next(iter(dataset))``). A stream
    that starts again with each iterator loses nothing by it; one that goes on where the
    last stopped from a source no attribute shows (a module's global iterator) and that the
    trials did not use up loses that sample to training: one more than the trials' samples
    it lost already, the price of telling whether it was used up."""
    if not isinstance(loader.dataset, IterableDataset):
        return False
    if not any(row["num_workers"] == 0 and row["batches_per_sec"] for row in table):
        return False
    try:
        next(iter(loader.dataset))
    except StopIteration:
        pass
    except Exception:  # its own error, met again where training reads it
        return False
    else:
        return False
    rank_zero_warn(
        "NumWorkersTuner: the IterableDataset gives no sample after the trials, which read "
        "batches from it: its stream goes on where the last iterator stopped, and the trials "
        "used it up, so training gets none of it. Open the source in `__iter__`, so that each "
        "iterator reads the stream from its start."
    )
    return True


def _keep(cache_path: Path, result: TuneResult) -> None:
    """Cache ``result`` if every candidate was measured; else say why it is not kept."""
    failed = sum(1 for row in result.table if row["skipped"])
    if not failed:
        _result_cache.write_cache(cache_path, result)
        return
    # A choice that failures forced would outlive their cause (a dataset fixed since).
    rank_zero_info(
        f"NumWorkersTuner: {failed} of {len(result.table)} candidates failed, so this result is "
        f"not cached; the next run measures again."
    )


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
    candidates failed (crash, hang, pickling) is measured again next time. An
    ``IterableDataset`` holding a source that reading uses up (an iterator, a file, a
    socket, a queue opened in ``__init__``) is not measured: the loader is returned as
    given, with ``untuned`` saying why.

    Args:
        dataloader: the loader to tune; it is not modified.
        max_workers: most workers to try; default the per-rank CPU budget.
        local_world_size: ranks sharing this machine's cores.
        batches: batches timed per candidate (after warm-up), over several epochs
            where one is shorter. 30 is enough for a stable rate when a batch takes
            milliseconds; raise it for noisy data.
        warmup_batches: batches per candidate left untimed after workers start (and
            then the ``num_workers * prefetch_factor`` they may have made ahead).
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
            default, ``batches`` batches after worker start-up, ``warmup_batches`` and
            the ``num_workers * prefetch_factor`` batches the workers may have made
            ahead (an epoch that ends first is followed by the next), within
            ``timeout`` and what is left of ``time_budget``. Pass your own to
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
    _check_worker_arguments(
        max_workers=max_workers, batches=batches, warmup_batches=warmup_batches,
        local_world_size=local_world_size, min_seconds=min_seconds, min_gain=min_gain,
        time_budget=time_budget, timeout=timeout, cache=cache, cache_dir=cache_dir,
        force=force, progress=progress,
    )  # fmt: skip

    held = held_source(dataloader.dataset)
    if held is not None:
        return _left_as_given(dataloader, held)
    budget = cpu_budget(local_world_size) if max_workers is None else max_workers
    cache_path = (
        Path(cache_dir or default_cache_dir())
        / f"{_result_cache.fingerprint(dataloader, local_world_size, budget)}.json"
    )
    if cache and not force:
        cached = _result_cache.read_cache(cache_path)
        if cached is not None and cached.best.get("num_workers", 0) <= budget:
            cached.dataloader = rebuild_dataloader(dataloader, **cached.best)
            log.info("num_workers: using the cached result %s", cached.best)
            return cached

    # Trial loaders draw random numbers (their shuffles): the first epoch shuffles as it
    # would have without the search.
    with random_state_kept(loader_generators(dataloader)):
        start = _clock()

        def timed(trial: DataLoader[Any]) -> float:
            remaining = time_budget - (_clock() - start)
            return _measure(trial, warmup_batches, batches, max(1.0, remaining), timeout,
                            min_seconds, clock=_clock)  # fmt: skip

        table, best, best_rate, given_rate = _search(
            dataloader, budget, measure or timed, min_gain=min_gain, time_budget=time_budget,
            timeout=timeout, start=start, progress=progress,
        )  # fmt: skip
        with kept_positions(dataloader.dataset):  # it reads a sample: in-memory files go back
            used_up = _used_up(dataloader, table)

    if not best:
        best = dict(_candidates.IN_PROCESS)
        rank_zero_warn("NumWorkersTuner: every candidate failed; keeping num_workers=0.")
    result = TuneResult(best, table, best_rate, given_rate, seconds=_clock() - start)
    if cache and not used_up:
        _keep(cache_path, result)
    result.dataloader = rebuild_dataloader(dataloader, **best)
    return result
