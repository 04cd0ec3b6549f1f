"""MicroBatchTuner: the fastest micro-batch that fits, at an unchanged global batch.

At a fixed global batch (samples per optimizer step), the micro-batch only decides
how the work of a step is cut: ``global / (micro x world)`` forward-backward passes
of ``micro`` samples each. Gradient communication and the optimizer step are paid
once per optimizer step whatever the cut, so the micro-batch to use is the one whose
forward and backward process the most samples per second. Larger is not always
faster (caches, memory traffic, a kernel's sweet spot): it is measured.

:func:`tune_micro_batch` times the real step (forward and backward, grads then
dropped) at growing micro-batches drawn from the user's own loader, stops at the
first one that would not fit in memory (or at ``max_micro_batch``), and keeps the
fastest in samples/s. The model comes back exactly as it was: gradients, buffers
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

import contextlib
import copy
import logging
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset

from lightning_speedkit import _compat, _validation
from lightning_speedkit.data.worker_search import _generators, rebuild_dataloader
from lightning_speedkit.errors import SpeedkitConfigError
from lightning_speedkit.schedule.accumulation_scheduler import AccumulationScheduler

__all__ = [
    "MicroBatchResult",
    "MicroBatchTuner",
    "StepMeasurement",
    "memory_limit",
    "timed_measure",
    "tune_micro_batch",
]

log = logging.getLogger(__name__)

GIB = 2**30


@dataclass(frozen=True)
class StepMeasurement:
    """One candidate's training step, as measured."""

    seconds: float
    """Forward and backward of one micro-batch (median of the timed runs)."""
    peak_bytes: int | None = None
    """Peak memory while it ran (device allocator on CUDA, resident set on CPU); None: unknown."""


Measure = Callable[[Callable[[], None], int], StepMeasurement]
"""``measure(run, micro_batch)``: run the step as often as it likes and say what it saw."""


@dataclass
class MicroBatchResult:
    """What tuning found.

    Attributes:
        best: DataLoader keyword arguments to use: ``{"batch_size": n}``.
        table: every candidate, in order: ``micro_batch``, ``samples_per_sec``,
            ``step_ms``, ``peak_bytes``, ``fits`` and ``skipped`` (why it did not run
            or does not count, else None).
        best_samples_per_sec: the measured rate of ``best``.
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


# --- memory ------------------------------------------------------------------------------------


def _proc_kib(path: str, key: str) -> int | None:
    """A ``key: N kB`` line of a /proc file, in KiB; None where it cannot be read."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_limit(
    device: torch.device | str, memory_headroom: float = 0.1, reserve_bytes: int = 0
) -> int | None:
    """The peak memory a trial step may reach on ``device``, in bytes; None if unknown.

    What the process holds now, plus ``1 - memory_headroom`` of what is free, less
    ``reserve_bytes`` (memory training will add that a trial does not). On CUDA in
    the allocator's terms (``max_memory_allocated``); on CPU in the resident set's
    (Linux ``/proc``).

    Example::

        >>> limit = memory_limit("cpu", memory_headroom=0.5)
        >>> limit is None or limit > 0
        True
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        spare = torch.cuda.memory_reserved(device) - allocated  # the caching allocator's
        return int(allocated + (1 - memory_headroom) * (free + spare)) - reserve_bytes
    if device.type == "cpu":
        held = _proc_kib("/proc/self/status", "VmRSS")
        available = _proc_kib("/proc/meminfo", "MemAvailable")
        if held is None or available is None:
            return None
        return int(1024 * (held + (1 - memory_headroom) * available)) - reserve_bytes
    return None


class _Peak:
    """The peak memory of a stretch of work: the allocator's on CUDA, the resident set's on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu":
            with contextlib.suppress(OSError):  # without it VmHWM is the process's peak so far
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)

    def read(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.device.type == "cpu":
            peak = _proc_kib("/proc/self/status", "VmHWM")
            return None if peak is None else 1024 * peak
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # SYNC: tuning only, before training, to time the step


def timed_measure(device: torch.device | str, warmup: int = 1, repeats: int = 3) -> Measure:
    """The default measurement: ``warmup`` untimed runs, then the median of ``repeats``.

    The peak memory covers the warm-up too (the first run at a new shape allocates
    most). On CUDA the device is synchronised around each timed run.
    """
    device = torch.device(device)
    peak = _Peak(device)

    def measure(run: Callable[[], None], micro_batch: int) -> StepMeasurement:
        peak.reset()
        for _ in range(warmup):
            run()
        times = []
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            times.append(time.perf_counter() - start)
        return StepMeasurement(statistics.median(times), peak.read())

    return measure


def _predicted_peak(rows: list[dict[str, Any]], micro_batch: int) -> int | None:
    """The peak at ``micro_batch``, on the line through the last two measured peaks."""
    measured = [(r["micro_batch"], r["peak_bytes"]) for r in rows if r["peak_bytes"] is not None]
    if len(measured) < 2:
        return None
    (n1, p1), (n2, p2) = measured[-2:]
    per_sample = max(0.0, (p2 - p1) / (n2 - n1))
    return int(p2 + per_sample * (micro_batch - n2))


# --- keeping everything as it was --------------------------------------------------------------


@contextlib.contextmanager
def _preserved(model: nn.Module, loader: DataLoader[Any]) -> Iterator[None]:
    """Gradients, buffers, modes and random states of ``model`` and ``loader``, put back after."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    # By name: a forward may assign a new tensor (``self.count = self.count + 1``).
    buffers = [(m, name, b, b.detach().clone()) for m in model.modules()
               for name, b in m.named_buffers(recurse=False)]  # fmt: skip
    modes = [(m, m.training) for m in model.modules()]
    # What a training step counts outside tensors (``self.seen += n``), and torchmetrics'
    # states (not buffers): a trial's updates would show in the first epoch's metrics.
    scalars = [(m, {k: v for k, v in vars(m).items() if type(v) in (int, float, bool)})
               for m in model.modules()]  # fmt: skip
    metrics = [(m, copy.deepcopy(_compat.metric_state(m))) for m in model.modules()
               if _is_metric(m)]  # fmt: skip
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    generators = _generators(loader)
    generator_states = [g.get_state() for g in generators]
    try:
        for p in params:
            p.grad = None
        model.train()
        yield
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        with torch.no_grad():
            for m, name, buffer, saved in buffers:
                buffer.copy_(saved)
                setattr(m, name, buffer)  # the buffer object it had, should it hold another
        for m, training in modes:
            m.training = training
        for m, values in scalars:
            vars(m).update(values)
        for m, kept in metrics:
            for name, value in kept.items():
                setattr(m, name, value)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        random.setstate(python_state)
        if numpy is not None and numpy_state is not None:
            numpy.random.set_state(numpy_state)
        for generator, state in zip(generators, generator_states, strict=True):
            generator.set_state(state)


def _is_metric(module: nn.Module) -> bool:
    metric = getattr(sys.modules.get("torchmetrics"), "Metric", None)
    return metric is not None and isinstance(module, metric)


def _eager() -> contextlib.AbstractContextManager[Any]:
    """Compiled code set aside: every trial shape would otherwise compile (and count) anew."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


# --- the search --------------------------------------------------------------------------------


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


def _default_candidates(given: int | None, cap: int | None) -> list[int]:
    top = cap if cap is not None else 2**20
    sizes, n = [], 1
    while n <= top:
        sizes.append(n)
        n *= 2
    if given is not None and given <= top:
        sizes.append(given)
    return sorted(set(sizes))


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
) -> MicroBatchResult:
    """Time the training step at growing micro-batches; return the fastest that fits.

    Candidates run smallest first, each on the first batch of that size the loader's
    own dataset, sampler and collate_fn give (loaded in this process). A size whose
    step raises (batch norm refuses a single sample) is skipped; the error is raised
    only if every size fails. The search stops at the first candidate predicted or
    measured over the memory limit, or out of memory, or past ``max_micro_batch``;
    the fastest in samples/s of those that fit wins (the loader's own size when none
    does). The model, its gradients,
    buffers and modes, and all random states come back as they were; compiled code
    is set aside during the trials (each new shape would compile anew).

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
            :func:`timed_measure` (one warm-up, median of three).
        agree: ranks running in lockstep pass a function that returns True only if
            every rank's argument is True; each candidate runs only then, and a size
            counts only if it fitted on every rank.

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
    _validation.positive_int("world_size", world_size)
    if global_batch is not None:
        _validation.positive_int("global_batch", global_batch)
        if global_batch % world_size:
            fix = "choose a global batch each rank can take an equal share of"
            _validation.fail("global_batch", global_batch,
                             f"is not a multiple of the {world_size} ranks", fix)  # fmt: skip
    given = dataloader.batch_size
    if given is None:  # a batch sampler of the user's, or no batching
        why, fix = _why_unbatched(dataloader)
        _validation.fail("dataloader", dataloader, f"must batch by `batch_size` ({why})", fix)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        _validation.fail("model", model,
                         "has no parameters that require grad, so its training step has "
                         "nothing to run backward into and no micro-batch can be timed",
                         "tune a model with trainable parameters, or keep the loader's "
                         "batch size as it is")  # fmt: skip
    started = time.perf_counter()
    device = trainable[0].device
    per_rank = None if global_batch is None else global_batch // world_size
    caps = [c for c in (max_micro_batch, per_rank) if c is not None]
    cap = min(caps) if caps else None
    sizes = candidates or _default_candidates(given, cap)
    sizes = [
        n for n in sizes if (cap is None or n <= cap) and (per_rank is None or per_rank % n == 0)
    ]
    left_out = [n for n in candidates or () if n not in sizes]
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
    limit = (
        limit_bytes
        if limit_bytes is not None
        else memory_limit(device, memory_headroom, reserve_bytes)
    )
    measure = measure or timed_measure(device)
    agree = agree or (lambda ok: ok)
    move = to_device or (lambda batch: _to(batch, device))
    params = list(model.parameters())

    table: list[dict[str, Any]] = []
    failures: list[Exception] = []
    stopped: str | None = None  # why this rank tries no larger micro-batch
    with _preserved(model, dataloader), _eager(), torch.enable_grad():
        for n in sizes:
            row: dict[str, Any] = {"micro_batch": n, "samples_per_sec": None, "step_ms": None,
                                   "peak_bytes": None, "fits": False, "skipped": None}  # fmt: skip
            predicted = _predicted_peak(table, n)
            if (
                stopped is None
                and limit is not None
                and predicted is not None
                and predicted > limit
            ):
                row["skipped"] = stopped = (
                    f"predicted peak {predicted / GIB:.2f} GiB over the limit {limit / GIB:.2f} GiB"
                )
                table.append(row)
            if not agree(stopped is None):  # every rank goes on, or none does
                if stopped is None:
                    row["skipped"] = "another rank stopped"
                    table.append(row)
                break
            table.append(row)
            trial = rebuild_dataloader(dataloader, batch_size=n, num_workers=0)
            batch = next(iter(trial), None)  # None: drop_last and fewer than n samples
            samples = 0 if batch is None else _samples(trial, batch)
            if samples < n:
                row["skipped"] = stopped = (
                    f"the dataset gives only {samples} samples per batch"
                    if batch is not None
                    else f"the dataset holds fewer than {n} samples (drop_last)"
                )
                continue
            batch = move(batch)

            def run(batch: Any = batch) -> None:
                _loss(step(batch)).backward()
                for p in params:
                    p.grad = None

            try:
                measured = measure(run, n)
            except Exception as exc:
                if not _out_of_memory(exc):  # e.g. batch norm refuses one sample: the next size
                    failures.append(exc)
                    row["skipped"] = f"the step failed: {type(exc).__name__}: {_first_line(exc)}"
                    continue
                row["skipped"] = stopped = f"out of memory ({type(exc).__name__})"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            finally:
                for p in params:
                    p.grad = None
            peak = measured.peak_bytes
            row["step_ms"] = 1e3 * measured.seconds
            row["samples_per_sec"] = n / measured.seconds if measured.seconds > 0 else None
            row["peak_bytes"] = peak
            row["fits"] = limit is None or peak is None or peak <= limit
            if not row["fits"]:
                row["skipped"] = stopped = (
                    f"peak {peak / GIB:.2f} GiB over the limit {limit / GIB:.2f} GiB"  # type: ignore[operator]
                )
    for row in table:  # a size counts only where it fits on every rank (one call each)
        if agree(bool(row["fits"])) or not row["fits"]:
            continue
        row["fits"] = False
        row["skipped"] = "does not fit on another rank"
    if failures and not any(row["samples_per_sec"] for row in table):
        raise failures[0]  # the step fails at every size: the user's error, not a size's
    fitting = [r for r in table if r["fits"] and r["samples_per_sec"]]
    if fitting:
        best_row = max(fitting, key=lambda r: r["samples_per_sec"])
        best, rate = int(best_row["micro_batch"]), float(best_row["samples_per_sec"])
    else:
        best, rate = int(given), None
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


def _why_unbatched(loader: DataLoader[Any]) -> tuple[str, str]:
    """Why ``loader``, whose ``batch_size`` is None, has no batch size the tuner could set;
    and the fix."""
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


def _out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError, Python's MemoryError, or the RuntimeError torch raises
    elsewhere for the same (the CPU allocator's "can't allocate memory", an older CUDA's
    "out of memory")."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower()
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


# --- the callback -------------------------------------------------------------------------------


def _optimizer_state_bytes(optimizers: Sequence[Any]) -> int:
    """Bytes of optimizer state not created yet (torch creates it at the first step).

    Two tensors the size of each parameter (Adam's moments), one for SGD with
    momentum, Adagrad and RMSprop, none for plain SGD: an estimate, for the memory
    limit only.
    """
    total = 0
    for wrapped in optimizers:
        optimizer = wrapped
        for _ in range(4):
            if isinstance(optimizer, torch.optim.Optimizer):
                break
            optimizer = getattr(optimizer, "optimizer", None)
        if not isinstance(optimizer, torch.optim.Optimizer):
            continue
        name = type(optimizer).__name__
        for group in optimizer.param_groups:
            if name == "SGD":
                per = 1 if group.get("momentum") else 0
            elif name in ("Adagrad", "RMSprop"):
                per = 1
            else:
                per = 2
            for p in group["params"]:
                if not optimizer.state.get(p):
                    total += per * p.numel() * p.element_size()
    return total


@contextlib.contextmanager
def _no_logging(module: L.LightningModule) -> Iterator[None]:
    """``self.log`` is for the fit loop's steps: in a trial step it does nothing."""
    had = {name: name in module.__dict__ for name in ("log", "log_dict")}
    module.__dict__["log"] = module.__dict__["log_dict"] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for name, own in had.items():
            if not own:
                module.__dict__.pop(name, None)


class MicroBatchTuner(L.Callback):
    """Times the training step at growing micro-batches as fit starts and trains with the fastest.

    The optimizer keeps its global batch: the callback needs
    ``AccumulationScheduler(target_global_batch=N)`` among the callbacks, and only
    micro-batches that divide ``N / world_size`` are tried; the scheduler's
    accumulation then follows the chosen micro-batch. The train loader is rebuilt
    with the new ``batch_size`` and everything else of it kept (sampler, shuffling,
    collate_fn, the worker settings NumWorkersTuner chose), so Lightning still adds
    its DistributedSampler under DDP.

    It runs in ``on_fit_start``: after ``setup``, so the step it times has the
    kit's other changes (attention swap, activation checkpointing, compiled blocks,
    run uncompiled for the trials), on the device, in the Trainer's precision. The
    ranks run the candidates together and stop together, each timing its own step
    (without DDP's gradient sync, paid once per optimizer step whatever the
    micro-batch; the sharded strategies' forward communicates, and runs whole). A
    size counts only if it fitted on every rank; rank 0's timings choose among those.
    A training step that communicates itself (a contrastive loss's ``all_gather``)
    and runs out of memory on one rank only leaves the others waiting in it: bound
    the search with ``max_micro_batch`` there. The model and optimizer come back
    exactly as they were (see :func:`tune_micro_batch`).

    ``result`` holds ``best`` (``{"batch_size": n}``) and ``table`` (every candidate:
    samples/s, step time, peak memory, why it stopped). ``micro_batch/size``,
    ``micro_batch/accumulation`` and ``micro_batch/samples_per_sec`` are logged.
    The choice is saved in checkpoints: a resumed run trains with it again rather
    than timing anew (unless the world size no longer allows it).

    Args:
        candidates: micro-batch sizes to try; default powers of two (and the loader's
            own size) up to the bounds.
        max_micro_batch: the largest tried. Without it, memory and the global batch
            bound the search.
        memory_headroom: share of the memory free at the start that must stay free
            (0.1 = 10%). Raise it when other work shares the device; memory use
            varies with batch contents (caption lengths, image counts), and the
            trials see one batch per size.
        warmup: untimed runs per candidate (its first run allocates and picks kernels).
        repeats: timed runs per candidate; the median counts.
        measure: ``measure(run, micro_batch) -> StepMeasurement`` replacing the
            timing (a device-specific clock, or a fixed table in tests).
        verbose: print the table (rank 0).

    Example::

        >>> import lightning as L
        >>> from lightning_speedkit import AccumulationScheduler
        >>> trainer = L.Trainer(
        ...     callbacks=[MicroBatchTuner(max_micro_batch=64),
        ...                AccumulationScheduler(target_global_batch=256)],
        ...     logger=False,
        ... )
    """

    def __init__(
        self,
        candidates: Sequence[int] | None = None,
        max_micro_batch: int | None = None,
        memory_headroom: float = 0.1,
        *,
        warmup: int = 1,
        repeats: int = 3,
        measure: Measure | None = None,
        verbose: bool = True,
    ) -> None:
        self.candidates = _check_micro_batch_arguments(candidates, max_micro_batch, memory_headroom)
        _validation.non_negative_int("warmup", warmup, example=1)
        _validation.positive_int("repeats", repeats, example=3)
        fix = "pass `lambda run, micro_batch: StepMeasurement(...)`, or None"
        _validation.optional(_validation.function, "measure", measure, fix=fix)
        _validation.boolean("verbose", verbose)
        self.max_micro_batch = max_micro_batch
        self.memory_headroom = float(memory_headroom)
        self.warmup = warmup
        self.repeats = repeats
        self.measure = measure
        self.verbose = verbose
        self.result: MicroBatchResult | None = None
        self._scheduler: AccumulationScheduler | None = None
        self._chosen: int | None = None
        self._loaded: dict[str, Any] = {}
        self._pending: tuple[L.Trainer, DataLoader[Any]] | None = None
        self._counts: dict[str, Any] | None = None  # the Trainer's, before the new micro-batch

    # -- checks before anything runs ----------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._scheduler, self._chosen, self._pending = None, None, None
        self._restore_counts(trainer)  # a fit that raised
        _compat.drop_train_loader_change(trainer, "MicroBatchTuner")  # a fit that raised
        if isinstance(trainer.strategy, DeepSpeedStrategy):
            raise SpeedkitConfigError(
                "MicroBatchTuner cannot change the micro-batch under DeepSpeed: its engine is "
                "built with a fixed `train_micro_batch_size_per_gpu` before a step can be "
                "timed. Tune on one device or under DDP (or `fsdp_zero2`), then set the "
                "loader's `batch_size` to `result.best['batch_size']`; or remove the callback."
            )
        if not pl_module.automatic_optimization:
            raise SpeedkitConfigError(
                "MicroBatchTuner cannot keep the global batch under manual optimization: this "
                "LightningModule sets `automatic_optimization = False`, so its `training_step` "
                "accumulates gradients by hand, and the tuner cannot change how many "
                "micro-batches it accumulates (AccumulationScheduler, which does that for the "
                "tuner, drives automatic optimization only). Remove MicroBatchTuner and tune "
                "before fit: `result = tune_micro_batch(model, loader, step, global_batch=N)`; "
                "then train with `batch_size=result.best['batch_size']` and accumulate "
                "`result.accumulation` micro-batches per optimizer step in `training_step`."
            )
        callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        schedulers = [c for c in callbacks if isinstance(c, AccumulationScheduler)]
        scheduler = schedulers[0] if schedulers else None
        if scheduler is not None and scheduler.schedule is not None:
            raise SpeedkitConfigError(
                "MicroBatchTuner keeps one global batch, and AccumulationScheduler's `schedule` "
                "changes it during training. Use `target_global_batch=N` with the tuner, or "
                "remove the tuner and set the batch size yourself."
            )
        if scheduler is None or scheduler.target_global_batch is None:
            now = (
                f"today: your loader's batch_size x {trainer.accumulate_grad_batches} "
                f"(accumulate_grad_batches) x {trainer.world_size} (ranks)"
            )
            what = (
                "there is no AccumulationScheduler"
                if scheduler is None
                else "its AccumulationScheduler has no `target_global_batch`"
            )
            raise SpeedkitConfigError(
                f"MicroBatchTuner changes the micro-batch and keeps the optimizer's global batch, "
                f"so it needs that number, and {what}. Add "
                f"`AccumulationScheduler(target_global_batch=N)` to the callbacks, N the samples "
                f"per optimizer step you train with ({now}), and drop the Trainer's "
                f"`accumulate_grad_batches`."
            )
        if scheduler.target_global_batch % trainer.world_size:
            raise SpeedkitConfigError(
                f"`target_global_batch={scheduler.target_global_batch}` cannot be split evenly "
                f"over {trainer.world_size} ranks, so no micro-batch keeps it exactly; choose a "
                f"multiple of {trainer.world_size}."
            )
        self._scheduler = scheduler

    # -- tuning, once the model is on its device ------------------------------------------------

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        scheduler = self._scheduler
        if scheduler is None:
            return
        if getattr(trainer, "fast_dev_run", False):  # not in its stubs
            rank_zero_info("MicroBatchTuner: not tuning in a `fast_dev_run` (a smoke test).")
            return
        if trainer.limit_train_batches == 0:  # 0 or 0.0: the fit loop trains no batch
            rank_zero_info("MicroBatchTuner: `limit_train_batches=0`, no batch trains; not tuning.")
            return
        loader = _compat.train_loader_source(trainer).dataloader()
        if not isinstance(loader, DataLoader):
            rank_zero_warn(
                f"MicroBatchTuner tunes a single torch DataLoader; the train loader is a "
                f"{type(loader).__name__}, so its batch size is left as it is."
            )
            return
        if loader.batch_size is None:  # with a size, the loader made its batch sampler
            why, fix = _why_unbatched(loader)
            raise SpeedkitConfigError(
                f"MicroBatchTuner sets the train loader's `batch_size`, and {why}. To use the "
                f"tuner, {fix}; or remove MicroBatchTuner."
            )
        global_batch = int(scheduler.target_global_batch or 0)
        saved = self._saved_choice(global_batch, trainer.world_size)
        self._loaded = {}
        if saved is not None:
            self._keep(trainer, loader, saved, global_batch)
            return
        strategy = trainer.strategy
        wrapper = strategy.model
        direct = (
            wrapper is None or wrapper is pl_module or isinstance(wrapper, DistributedDataParallel)
        )

        def step(batch: Any) -> Any:
            with _no_logging(pl_module):
                if not direct:  # the wrapper's forward gathers shards: all ranks run it
                    return strategy.training_step(batch, 0)
                with strategy.precision_plugin.train_step_context():
                    return pl_module.training_step(batch, 0)

        # Every rank runs the same sizes and stops where any rank stops: a rank's own
        # search could end elsewhere (another device's memory), and a training step
        # that communicates (a contrastive loss's all_gather) would then hang.
        lockstep = trainer.world_size > 1
        self.result = tune_micro_batch(
            wrapper if wrapper is not None else pl_module,
            loader,
            step,
            candidates=self.candidates,
            max_micro_batch=self.max_micro_batch,
            memory_headroom=self.memory_headroom,
            global_batch=global_batch,
            world_size=trainer.world_size,
            to_device=lambda batch: strategy.batch_to_device(batch),
            reserve_bytes=_optimizer_state_bytes(trainer.optimizers),
            measure=self.measure or timed_measure(strategy.root_device, self.warmup, self.repeats),
            agree=(lambda ok: bool(strategy.reduce_boolean_decision(ok, all=True)))
            if lockstep
            else None,
        )
        best = int(strategy.broadcast(self.result.best["batch_size"], src=0))
        if best != self.result.best["batch_size"]:  # rank 0's choice: this rank's result says so
            rates = [r["samples_per_sec"] for r in self.result.table if r["micro_batch"] == best]
            self.result = replace(
                self.result, best={"batch_size": best},
                best_samples_per_sec=rates[0] if rates else None,
                accumulation=global_batch // (best * trainer.world_size),
            )  # fmt: skip
        self._apply(trainer, loader, best, "")
        self._pending = (trainer, loader)

    def _saved_choice(self, global_batch: int, world_size: int) -> int | None:
        saved = self._loaded.get("batch_size")
        if not isinstance(saved, int) or self._loaded.get("global_batch") != global_batch:
            return None
        if (global_batch // world_size) % saved:
            rank_zero_info(
                f"MicroBatchTuner: the checkpoint's micro-batch {saved} does not divide the global "
                f"batch {global_batch} over {world_size} ranks; tuning again."
            )
            return None
        return saved

    def _apply(self, trainer: L.Trainer, loader: DataLoader[Any], best: int, how: str) -> None:
        assert self._scheduler is not None  # set in setup
        self._chosen = best
        first = loader if best == loader.batch_size else rebuild_dataloader(loader, batch_size=best)
        try:
            batches: int | None = len(first)
        except TypeError:  # an IterableDataset without a length
            batches = None
        self._count_in_new_batches(trainer, int(loader.batch_size or best), best, batches)
        # Loaders the fit loop requests later (`reload_dataloaders_every_n_epochs`) come
        # from the user's hook at its own batch size: each is resized too.
        _compat.change_train_loader(
            trainer, "MicroBatchTuner", partial(_resized, best=best), first, before_loop=True
        )
        self._scheduler.set_micro_batch_size(best)
        if not self.verbose:
            return
        target = self._scheduler.target_global_batch or best
        accumulation = max(1, target // (best * trainer.world_size))
        trained = best * accumulation * trainer.world_size
        cut = (
            f"micro-batch {best} x {accumulation} accumulation x {trainer.world_size} rank(s) = "
            f"global batch {trained}"
            + ("" if trained == target else f", not the target {target}: {best} does not divide it")
        )
        if how:
            rank_zero_info(f"MicroBatchTuner: {cut}, {how}.")
            return
        assert self.result is not None
        rank_zero_info(
            f"MicroBatchTuner: {cut} (was micro-batch {loader.batch_size}; tuned in "
            f"{self.result.seconds:.1f} s):\n{_table(self.result)}"
        )

    def _count_in_new_batches(
        self, trainer: L.Trainer, given: int, best: int, batches: int | None
    ) -> None:
        """Keep what the Trainer's batch counts mean in samples: ``limit_train_batches=16``
        of micro-batches of 4 become 8 of 8 (the same 64 samples and, where the sizes
        divide, the same optimizer steps), and so does an integer ``val_check_interval``,
        at most the new epoch's ``batches`` (an interval of a whole epoch whose last
        batch was short stays one epoch). Fractions are kept."""
        if self._counts is None:
            self._counts = {name: getattr(trainer, name) for name in _BATCH_COUNTS}
        epoch = batches
        for name, value in self._counts.items():
            setattr(trainer, name, value)
            if not isinstance(value, int) or isinstance(value, bool) or best == given:
                continue
            if name == "limit_train_batches" and getattr(trainer, "overfit_batches", None):
                continue  # the batches to overfit: the user's count, as given
            scaled = -(-value * given // best)  # rounded up: some stay some, none stays none
            if name == "val_check_interval" and epoch is not None:
                scaled = min(scaled, epoch)
            if name == "limit_train_batches" and epoch is not None:
                epoch = min(epoch, scaled)
            setattr(trainer, name, scaled)
            exact = (
                ""
                if scaled * best == value * given
                else f" (not {value * given / best:g}: the batches do not divide evenly)"
            )
            if not self.verbose:
                continue
            rank_zero_info(
                f"MicroBatchTuner: `{name}={value}` counted batches of {given}; it is {scaled} "
                f"micro-batches of {best} now{exact}, the same samples."
            )

    def _restore_counts(self, trainer: L.Trainer) -> None:
        for name, value in (self._counts or {}).items():
            setattr(trainer, name, value)
        self._counts = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pending = None
        if self._chosen is None or self._scheduler is None:
            return
        global_batch = self._scheduler.target_global_batch or self._chosen
        metrics = {
            "micro_batch/size": float(self._chosen),
            "micro_batch/accumulation": float(global_batch // (self._chosen * trainer.world_size)),
        }
        if self.result is not None and self.result.best_samples_per_sec:
            metrics["micro_batch/samples_per_sec"] = self.result.best_samples_per_sec
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # the next fit requests the user's loaders and counts as they are
            _compat.drop_train_loader_change(trainer, "MicroBatchTuner")
            self._restore_counts(trainer)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning calls no teardown after a raise

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        if self._chosen is None or self._scheduler is None:
            return {}
        return {"batch_size": self._chosen, "global_batch": self._scheduler.target_global_batch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)
        if self._pending is None:
            return
        # Strategies that restore after setup (FSDP) load this after on_fit_start tuned:
        # the loader is not built yet, so the checkpoint's choice still wins.
        trainer, loader = self._pending
        scheduler = self._scheduler
        global_batch = int(scheduler.target_global_batch or 0) if scheduler else 0
        saved = self._saved_choice(global_batch, trainer.world_size)
        self._loaded = {}
        if saved is not None:
            self._keep(trainer, loader, saved, global_batch)

    def _keep(
        self, trainer: L.Trainer, loader: DataLoader[Any], saved: int, global_batch: int
    ) -> None:
        """Train with a checkpoint's micro-batch, untimed: ``result`` has it, no table."""
        self.result = MicroBatchResult(
            best={"batch_size": saved}, table=[], best_samples_per_sec=None,
            given=loader.batch_size, global_batch=global_batch,
            accumulation=global_batch // (saved * trainer.world_size),
        )  # fmt: skip
        self._apply(trainer, loader, saved, f"kept from the checkpoint ({saved})")


#: Trainer settings counted in train loader batches (integers; fractions are shares).
_BATCH_COUNTS = ("limit_train_batches", "val_check_interval")


def _resized(loader: Any, best: int) -> Any:
    """A train loader the fit loop requested again (a reload), at the tuned micro-batch."""
    if not isinstance(loader, DataLoader):
        raise SpeedkitConfigError(
            f"MicroBatchTuner trains at micro-batch {best}, and the train loader reloaded for "
            f"this epoch is a {type(loader).__name__}, not a torch DataLoader, so its batch size "
            f"cannot be set and the global batch would change. Return a DataLoader from "
            f"`train_dataloader()`, or remove MicroBatchTuner."
        )
    return loader if loader.batch_size == best else rebuild_dataloader(loader, batch_size=best)


def _table(result: MicroBatchResult) -> str:
    lines = ["  micro-batch  samples/s   step ms   peak GiB  note"]
    for row in result.table:
        rate = f"{row['samples_per_sec']:10.1f}" if row["samples_per_sec"] else f"{'-':>10}"
        ms = f"{row['step_ms']:9.1f}" if row["step_ms"] is not None else f"{'-':>9}"
        peak = f"{row['peak_bytes'] / GIB:10.2f}" if row["peak_bytes"] is not None else f"{'-':>10}"
        note = row["skipped"] or ("best" if row["micro_batch"] == result.best["batch_size"] else "")
        lines.append(f"  {row['micro_batch']:>11} {rate} {ms} {peak}  {note}")
    return "\n".join(lines)
