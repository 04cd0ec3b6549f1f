"""tune_micro_batch: the fastest micro-batch that fits, at an unchanged global batch.

At a fixed global batch (samples per optimizer step), the micro-batch only decides
how the work of a step is cut: ``global / (micro x world)`` forward-backward passes
of ``micro`` samples each. Gradient communication and the optimizer step are paid
once per optimizer step whatever the cut, so the micro-batch to use is the one whose
forward and backward process the most samples per second. Larger is not always
faster (caches, memory traffic, a kernel's sweet spot): it is measured.

:func:`tune_micro_batch` times the real step (forward and backward, grads then
dropped) at growing micro-batches drawn from the user's own loader, stops at the
first one that would not fit in memory (or at ``max_micro_batch``), and keeps the
fastest in samples/s, once confirmed: the fastest and the runner-up are timed again
in turns (``A B A B A B``), so a busy spell over one size's runs cannot decide the
pick. The model comes back exactly as it was: gradients, buffers
(batch-norm statistics), train/eval modes, and every random state the trials
touched (torch's, CUDA's, Python's, NumPy's, the loader's generators).

Memory, per candidate, is the peak while its step ran, against a limit taken when
tuning starts:

- CUDA: ``torch.cuda.max_memory_allocated`` against what the process holds plus
  ``(1 - memory_headroom)`` of what is free (``torch.cuda.mem_get_info``, plus the
  caching allocator's spare blocks).
- CPU: the process's peak resident set (Linux ``VmHWM``) against what it holds plus
  ``(1 - memory_headroom)`` of the host's ``MemAvailable``.

In both, memory the training will add that a trial does not (optimizer states,
created at the first optimizer step) is reserved up front. Before a candidate
runs, its peak is extrapolated from the two before it; one predicted over the limit
is not run. On other devices (or without ``/proc``) only ``max_micro_batch`` and
the global batch bound the search.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_speedkit import _validation
from lightning_speedkit._surgery import side_run
from lightning_speedkit.compute._candidate_walk import (
    Skipped,
    Trial,
    candidate_sizes,
    confirm,
    verdict,
    walk,
)
from lightning_speedkit.compute._memory_probe import GIB, memory_limit, out_of_memory
from lightning_speedkit.compute._step_timer import Measure, StepMeasurement, timed_measure
from lightning_speedkit.compute._trial_state import eager, preserved
from lightning_speedkit.data.bucketing import LengthBucketBatchSampler
from lightning_speedkit.data.worker_search import rebuild_dataloader

__all__ = ["MicroBatchResult", "tune_micro_batch"]


@dataclass
class MicroBatchResult:
    """What tuning found.

    Attributes:
        best: DataLoader keyword arguments to use: ``{"batch_size": n}``.
        table: every candidate, in order: ``micro_batch``, ``samples_per_sec``,
            ``step_ms``, ``peak_bytes``, ``fits``, ``skipped`` (why it did not run
            or does not count, else None) and ``confirmed_samples_per_sec`` (the
            rate re-timed in turns with the other of the two fastest, else None).
        best_samples_per_sec: the measured rate of ``best`` (the re-timed one where
            it was confirmed).
        given: the loader's batch size as given.
        accumulation: micro-batches per optimizer step at ``best`` (with a global batch).
        global_batch: the global batch kept (None if none was given).
        memory_limit: the peak in bytes a candidate had to stay under (None: unknown).
        seconds: time spent tuning.
        dataloader: the loader rebuilt with ``best``.
    """

    best: dict[str, int]
    table: list[dict[str, Any]]
    best_samples_per_sec: float | None
    given: int | None = None
    accumulation: int | None = None
    global_batch: int | None = None
    memory_limit: int | None = None
    seconds: float = 0.0
    dataloader: DataLoader[Any] | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("dataloader")
        return data


def _check_micro_batch_arguments(
    candidates: Sequence[int] | None, max_micro_batch: int | None, memory_headroom: float
) -> list[int] | None:
    """Refuse bad arguments, naming the argument (shared by the function and the callback)."""
    if candidates is not None:
        given = candidates
        # Any iterable of sizes (a list, a range, a numpy array), not a string or a mapping.
        listed = (
            None
            if isinstance(given, (str, bytes, Mapping)) or not isinstance(given, Iterable)
            else list(given)
        )
        if not listed:
            fix = "pass e.g. `candidates=[8, 16, 32]`, or None for powers of two"
            _validation.fail("candidates", given,
                             "must be a non-empty list of micro-batch sizes", fix)  # fmt: skip
        candidates = sorted(
            {_validation.positive_int(f"candidates[{i}]", c) for i, c in enumerate(listed)}
        )
    _validation.optional(_validation.positive_int, "max_micro_batch", max_micro_batch,
                         hint="or None to stop at memory")  # fmt: skip
    if candidates and max_micro_batch is not None and max_micro_batch < candidates[0]:
        _validation.fail("max_micro_batch", max_micro_batch,
                         f"is below every candidate ({candidates})",
                         "raise it, or give smaller candidates")  # fmt: skip
    _validation.probability("memory_headroom", memory_headroom, high_open=True, example=0.1,
                            hint="the share of free memory kept free")  # fmt: skip
    return candidates


def _loss(output: Any) -> Tensor:
    if isinstance(output, Mapping):
        output = output.get("loss")
    if not isinstance(output, Tensor):
        raise RuntimeError(
            f"the training step returned {type(output).__name__}, not a loss tensor (or a dict "
            f"with 'loss'); the micro-batch tuner needs one to run backward"
        )
    return output


def tune_micro_batch(
    model: nn.Module,
    dataloader: DataLoader[Any],
    step: Callable[[Any], Any],
    *,
    candidates: Sequence[int] | None = None,
    max_micro_batch: int | None = None,
    memory_headroom: float = 0.1,
    global_batch: int | None = None,
    world_size: int = 1,
    to_device: Callable[[Any], Any] | None = None,
    reserve_bytes: int = 0,
    limit_bytes: int | None = None,
    measure: Measure | None = None,
    agree: Callable[[bool], bool] | None = None,
    confirm_rounds: int = 3,
) -> MicroBatchResult:
    """Time the training step at growing micro-batches; return the fastest that fits.

    Candidates run smallest first, each on the first batch of that size the loader's
    own dataset, sampler and collate_fn give (loaded in this process). A size whose
    step raises (batch norm refuses a single sample) is skipped; the error is raised
    only if every size fails. The search stops at the first candidate predicted or
    measured over the memory limit, or out of memory, or past ``max_micro_batch``;
    the fastest in samples/s of those that fit wins (the loader's own size when none
    does), once confirmed: it and the runner-up are re-timed in turns, and the faster
    by those medians wins. The model, its gradients,
    buffers and modes, and all random states come back as they were; compiled code
    is set aside during the trials (each new shape would compile anew), and a
    FrozenFeatureCache in the model neither serves, stores nor counts them.

    Args:
        model: the module whose parameters the step trains (its state is preserved).
        dataloader: the train loader; batched by ``batch_size`` (not a custom batch
            sampler). It is not modified.
        step: ``batch -> loss`` (or a dict with ``"loss"``): the forward of the training
            step; backward is run on the result.
        candidates: micro-batch sizes to try; default powers of two (and the loader's
            own size) up to the other bounds.
        max_micro_batch: largest micro-batch tried.
        memory_headroom: share of the memory free at the start that stays free.
        global_batch: samples per optimizer step over all ranks, kept: only sizes that
            divide ``global_batch / world_size`` are tried.
        world_size: data-parallel ranks.
        to_device: moves a batch to the model's device (default: every tensor in it).
        reserve_bytes: memory the training will hold that a trial does not
            (optimizer states before the first step).
        limit_bytes: the peak a candidate may reach, instead of :func:`memory_limit`'s.
        measure: ``measure(run, micro_batch) -> StepMeasurement`` instead of
            :func:`timed_measure` (one warm-up, then the median of at least three
            runs and of at least 20 ms of them).
        agree: ranks running in lockstep pass a function that returns True only if
            every rank's argument is True; each candidate runs only then, and a size
            counts only if it fitted on every rank.
        confirm_rounds: re-timings each of the fastest size and the runner-up, taken
            in turns after the search; 0 keeps the first measurements. Each round
            costs one measurement of each (3: about three times measuring the two
            once more); raise it on a machine others share.

    Example::

        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> model = torch.nn.Linear(8, 1)
        >>> loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=4)
        >>> def step(batch):
        ...     x, y = batch
        ...     return torch.nn.functional.mse_loss(model(x), y)
        >>> seconds = {4: 0.004, 8: 0.005, 16: 0.012}  # a fake clock: 8 is the fastest per sample
        >>> fake = lambda run, n: (run(), StepMeasurement(seconds[n]))[1]
        >>> result = tune_micro_batch(model, loader, step, global_batch=16, candidates=[4, 8, 16],
        ...                           measure=fake)
        >>> result.best, result.accumulation
        ({'batch_size': 8}, 2)
        >>> model.weight.grad is None
        True
    """
    candidates = _check_micro_batch_arguments(candidates, max_micro_batch, memory_headroom)
    _validation.non_negative_int("confirm_rounds", confirm_rounds, example=3,
                                 hint="or 0 to keep the first measurements")  # fmt: skip
    trainable = _check_tune_inputs(model, dataloader, global_batch, world_size)
    started = time.perf_counter()
    device = trainable[0].device
    given = dataloader.batch_size
    per_rank = None if global_batch is None else global_batch // world_size
    sizes = _sizes_to_try(candidates, given, max_micro_batch, per_rank)
    limit = (
        limit_bytes
        if limit_bytes is not None
        else memory_limit(device, memory_headroom, reserve_bytes)
    )
    agree = agree or (lambda ok: ok)
    trial = _trial(
        model, dataloader, step, measure or timed_measure(device),
        to_device or (lambda batch: _to(batch, device)),
    )  # fmt: skip
    # side_run: a FrozenFeatureCache in the model neither serves, stores nor counts a trial.
    with preserved(model, dataloader), eager(), side_run(), torch.enable_grad():
        table, failures = walk(sizes, limit, trial, agree)
        best_row = confirm(table, verdict(table, agree), trial, agree, confirm_rounds)
    if failures and not any(row["samples_per_sec"] for row in table):
        raise failures[0]  # the step fails at every size: the user's error, not a size's
    if best_row is not None:
        best = int(best_row["micro_batch"])
        rate = float(best_row["confirmed_samples_per_sec"] or best_row["samples_per_sec"])
    else:
        best, rate = int(given), None  # type: ignore[arg-type]
        rank_zero_warn(
            f"MicroBatchTuner: no candidate micro-batch fitted ({table[0]['skipped']}); keeping "
            f"the loader's batch size {given}."
        )
    accumulation = None if per_rank is None else max(1, per_rank // best)
    result = MicroBatchResult(
        best={"batch_size": best}, table=table, best_samples_per_sec=rate, given=given,
        accumulation=accumulation, global_batch=global_batch, memory_limit=limit,
        seconds=time.perf_counter() - started,
    )  # fmt: skip
    result.dataloader = rebuild_dataloader(dataloader, batch_size=best)
    return result


def _check_tune_inputs(
    model: nn.Module, dataloader: DataLoader[Any], global_batch: int | None, world_size: int
) -> list[nn.Parameter]:
    """Refuse a global batch the ranks cannot share, an unbatched loader, a model with nothing
    to train; return the trainable parameters."""
    _validation.instance("model", model, nn.Module, what="a torch.nn.Module",
                         fix="pass the module whose parameters the step trains")  # fmt: skip
    _validation.positive_int("world_size", world_size)
    if global_batch is not None:
        _validation.positive_int("global_batch", global_batch)
        if global_batch % world_size:
            fix = "choose a global batch each rank can take an equal share of"
            _validation.fail("global_batch", global_batch,
                             f"is not a multiple of the {world_size} ranks", fix)  # fmt: skip
    if dataloader.batch_size is None:  # a batch sampler of the user's, or no batching
        why, fix = why_unbatched(dataloader)
        _validation.fail("dataloader", dataloader, f"must batch by `batch_size` ({why})", fix)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        _validation.fail("model", model,
                         "has no parameters that require grad, so its training step has "
                         "nothing to run backward into and no micro-batch can be timed",
                         "tune a model with trainable parameters, or keep the loader's "
                         "batch size as it is")  # fmt: skip
    return trainable


def _sizes_to_try(
    candidates: list[int] | None, given: int | None, max_micro_batch: int | None,
    per_rank: int | None,
) -> list[int]:  # fmt: skip
    """The candidates that keep the global batch; the ones left out are said, none refused."""
    sizes, left_out, cap = candidate_sizes(candidates, given, max_micro_batch, per_rank)
    if left_out and sizes:
        rank_zero_info(
            f"MicroBatchTuner: candidates {left_out} left out: the micro-batch must divide the "
            f"{per_rank} samples each rank contributes per optimizer step"
            + (f" and be at most {cap}" if cap is not None else "")
            + "."
        )
    if not sizes:
        _validation.fail("candidates", candidates,
                         f"holds no micro-batch that divides the {per_rank} samples each rank "
                         f"contributes per optimizer step and is at most {cap}",
                         "give sizes that divide it")  # fmt: skip
    return sizes


def _trial(
    model: nn.Module,
    dataloader: DataLoader[Any],
    step: Callable[[Any], Any],
    measure: Measure,
    move: Callable[[Any], Any],
) -> Trial:
    """``trial(n)``: the step measured on the loader's first batch of ``n`` samples.

    A dataset too small for ``n`` stops the search; so does running out of memory. Any
    other error of the step skips that size only (batch norm refuses a single sample).
    Gradients are dropped after every run.
    """
    params = list(model.parameters())
    device = next(p for p in params if p.requires_grad).device

    def trial(n: int) -> StepMeasurement | Skipped:
        loader = rebuild_dataloader(dataloader, batch_size=n, num_workers=0)
        batch = next(iter(loader), None)  # None: drop_last and fewer than n samples
        samples = 0 if batch is None else _samples(loader, batch)
        if samples < n:
            return Skipped(
                f"the dataset gives only {samples} samples per batch"
                if batch is not None
                else f"the dataset holds fewer than {n} samples (drop_last)",
                stop=True,
            )
        batch = move(batch)

        def run(batch: Any = batch) -> None:
            _loss(step(batch)).backward()
            for p in params:
                p.grad = None

        try:
            return measure(run, n)
        except Exception as exc:
            if not out_of_memory(exc):  # e.g. batch norm refuses one sample: the next size
                why = f"the step failed: {type(exc).__name__}: {_first_line(exc)}"
                return Skipped(why, error=exc)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return Skipped(f"out of memory ({type(exc).__name__})", stop=True)
        finally:
            for p in params:
                p.grad = None

    return trial


def why_unbatched(loader: DataLoader[Any]) -> tuple[str, str]:
    """Why ``loader``, whose ``batch_size`` is None, has no batch size the tuner could set;
    and the fix."""
    if isinstance(loader.batch_sampler, LengthBucketBatchSampler):  # the kit's own bucketing
        return (
            "this one batches with LengthBucketBatchSampler (length bucketing: "
            "SpeedDataModuleMixin's `lengths=`), whose own `batch_size` decides and which "
            "the tuner does not resize",
            "tune once without `lengths=` and pass the size it finds to "
            "`speed_dataloader(batch_size=...)` with `lengths=`",
        )
    if loader.batch_sampler is not None:  # the user's: DataLoader makes one only from a size
        return (
            f"this one batches with {type(loader.batch_sampler).__name__}, whose own size decides",
            "size that batch sampler yourself, or pass `batch_size=` instead of `batch_sampler=`",
        )
    return (
        "this one has `batch_size=None`: automatic batching is off, so each item the dataset "
        "gives is a whole batch",
        "if the dataset gives single samples, give the loader a `batch_size`; if it gives "
        "whole batches, size them in the dataset and do not tune",
    )


def _samples(loader: DataLoader[Any], batch: Any) -> int:
    """Samples in ``loader``'s first batch: the indices its sampler drew, for a map-style
    dataset (a batch's first tensor may be time-major, or a scalar); else the batch's size."""
    if not isinstance(loader.dataset, IterableDataset) and loader.batch_sampler is not None:
        return len(next(iter(loader.batch_sampler)))
    return int(extract_batch_size(batch))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _to(batch: Any, device: torch.device) -> Any:
    from lightning.fabric.utilities.apply_func import move_data_to_device

    return move_data_to_device(batch, device)


def table_text(result: MicroBatchResult) -> str:
    lines = ["  micro-batch  samples/s   step ms   peak GiB  note"]
    for row in result.table:
        rate = f"{row['samples_per_sec']:10.1f}" if row["samples_per_sec"] else f"{'-':>10}"
        ms = f"{row['step_ms']:9.1f}" if row["step_ms"] is not None else f"{'-':>9}"
        peak = f"{row['peak_bytes'] / GIB:10.2f}" if row["peak_bytes"] is not None else f"{'-':>10}"
        note = row["skipped"] or ("best" if row["micro_batch"] == result.best["batch_size"] else "")
        if row.get("confirmed_samples_per_sec"):  # re-timed in turns with the other fastest
            note = f"{note}{', ' if note else ''}re-timed {row['confirmed_samples_per_sec']:.1f}/s"
        lines.append(f"  {row['micro_batch']:>11} {rate} {ms} {peak}  {note}")
    return "\n".join(lines)
