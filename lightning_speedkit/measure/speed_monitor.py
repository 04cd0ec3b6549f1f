"""SpeedMonitor: throughput, MFU/HFU, step-time percentiles, data wait, memory; no user input.

How each figure is obtained, and what it costs:

- **FLOPs** are counted on a real training step (forward, backward and optimizer
  step, as the Trainer runs them) by :func:`count_flops`, once per distinct batch
  shape up to ``max_flop_counts`` shapes; other shapes are estimated from the
  counted ones by a linear fit in tokens per batch. A counted step is slower
  (every operator passes through Python) and is left out of the timings. Under the
  count, compiled blocks (RegionalCompile, ``torch.compile``) run eagerly and compile
  nothing, so with compiled parts the count waits for a step that ran them compiled
  without compiling (the step ProfilerSchedule's window waits for); a step torch's
  profiler records is not counted either (up to ``_PROFILED_SKIPS`` steps). Steps
  before the first count are left out of every figure, as warm-up is.
- **Samples** of a step are those of every train loader's batch in it: a dict or list
  of loaders (Lightning's CombinedLoader) trains one batch of each per step.
- **Time** on CPU is the host clock at the start and end of each batch. On CUDA it
  is a pair of CUDA events per batch, recorded without waiting and read once per
  log interval: the step time is the device time from the end of one batch to the
  end of the next, and **data wait** is the device's idle gap between the end of
  one batch and the start of the next (on CPU, the host's gap). Both include
  whatever else Lightning does between batches (checkpointing, for instance);
  validation and epoch boundaries are left out.
- **Across ranks** one small ``all_gather`` per log interval sums samples/s over
  ranks and gives the straggler ratio (slowest rank's mean step time over the
  median). Nothing else crosses ranks, and per-step hooks never synchronise the
  device.

Logged every ``log_every_n_steps`` batches (the Trainer's value by default)
through the Trainer's loggers, under ``speed/``: ``samples_per_sec``,
``tokens_per_sec``, ``tflops_per_device``, ``mfu``, ``hfu``, ``step_ms_p50``,
``step_ms_p90``, ``step_ms_p99``, ``data_wait_frac``, ``mem_peak_gib``,
``gpu_util`` (NVIDIA, with nvidia-ml-py) and ``straggler_ratio`` (DDP). A figure
that cannot be known (MFU on a device without a known peak) is left out, never
logged as 0.

At fit start it also warns, once, when the run trains in bf16 (mixed or true) on a
CPU without native bf16 instructions (Linux x86-64 with neither AVX512_BF16 nor
AMX_BF16, as torch reports them), where bf16 is emulated and several times slower
than float32.
"""

from __future__ import annotations

import math
import platform
import statistics
import sys
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_speedkit import _combined, _compat, _validation
from lightning_speedkit._imports import NVML_AVAILABLE
from lightning_speedkit.errors import SpeedkitConfigError
from lightning_speedkit.measure import peak as _peak
from lightning_speedkit.measure._clock import StepClock
from lightning_speedkit.measure._compile_watch import CompileWatch
from lightning_speedkit.measure._host_memory import host_memory_bytes
from lightning_speedkit.measure.flops import _Counter, _Owners, _tensors

__all__ = ["SUMMARY_KEYS", "SpeedMonitor"]

#: Keys of :attr:`SpeedMonitor.summary`; all but ``flops_per_sample`` are logged under ``speed/``.
SUMMARY_KEYS = (
    "samples_per_sec",
    "tokens_per_sec",
    "tflops_per_device",
    "mfu",
    "hfu",
    "step_ms_p50",
    "step_ms_p90",
    "step_ms_p99",
    "data_wait_frac",
    "mem_peak_gib",
    "gpu_util",
    "straggler_ratio",
    "flops_per_sample",
)

# Per-rank raw sums, gathered across ranks at log time. Order of the gathered vector.
_FIELDS = ("samples", "tokens", "time", "steps", "model_flops", "hw_flops", "wait", "mem_gib")
_GIB = 2**30
#: Steps per fit a FLOP count waits for torch's profiler to be off (a ProfilerSchedule
#: window); past them it counts under the profiler (a profiler open for the whole fit).
_PROFILED_SKIPS = 16


# --- batch inspection (host metadata only: shapes and dtypes, never values) ----------------


@dataclass(frozen=True)
class _BatchInfo:
    signature: tuple[tuple[tuple[int, ...], str], ...]
    samples: int
    tokens: int | None

    @cached_property
    def key(self) -> str:
        """The signature as a checkpoint-friendly string (computed once per batch)."""
        return repr(self.signature)


def _number(value: Any, argument: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu":
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpeedkitConfigError(
            f"`{argument}` must return a finite number for each batch, got {value!r} "
            f"({type(value).__name__}). Return a Python int or float, e.g. "
            f"`lambda batch: batch['input_ids'].numel()`."
        )
    if value < 0:
        raise SpeedkitConfigError(f"`{argument}` returned {value}; it must be 0 or more.")
    return float(value)


# --- FLOPs per batch shape -----------------------------------------------------------------


@dataclass
class _Counted:
    samples: int
    tokens: int | None
    model: float
    hardware: float


class _FlopBook:
    """Counted FLOPs per batch signature, and estimates for signatures not counted."""

    def __init__(self) -> None:
        self.counted: dict[str, _Counted] = {}
        self._estimates: dict[str, tuple[float, float] | None] = {}

    def add(self, key: str, counted: _Counted) -> None:
        self.counted[key] = counted
        self._estimates.clear()  # a new point changes the fit

    def for_batch(self, info: _BatchInfo) -> tuple[float, float] | None:
        """(model, hardware) FLOPs of a batch: counted, or estimated once per shape."""
        counted = self.counted.get(info.key)
        if counted is not None:
            return counted.model, counted.hardware
        if info.key not in self._estimates:
            self._estimates[info.key] = self.estimate(info)
        return self._estimates[info.key]

    def estimate(self, info: _BatchInfo) -> tuple[float, float] | None:
        if not self.counted:
            return None
        same = [c for c in self.counted.values() if c.samples == info.samples and c.tokens]
        if info.tokens is not None and len({c.tokens for c in same}) >= 2:
            # Least squares of FLOPs on tokens among batches of this many samples.
            xs = [float(c.tokens or 0) for c in same]
            mean_x = statistics.fmean(xs)
            var = sum((x - mean_x) ** 2 for x in xs)
            out = []
            for ys in ([c.model for c in same], [c.hardware for c in same]):
                mean_y = statistics.fmean(ys)
                slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
                out.append(max(0.0, mean_y + slope * (info.tokens - mean_x)))
            return out[0], out[1]
        # Otherwise scale the closest counted batch by samples (and tokens when known).
        ref = min(
            self.counted.values(),
            key=lambda c: (
                abs(c.samples - info.samples),
                abs((c.tokens or 0) - (info.tokens or 0)),
            ),
        )
        scale = info.samples / ref.samples
        if info.tokens and ref.tokens:
            scale = info.tokens / ref.tokens
        return ref.model * scale, ref.hardware * scale


class _FlopSession:
    """A FLOP count spanning two hooks (batch start to batch end).

    While open it holds a dispatch mode and global module hooks, so every operator in
    the process goes through Python: :meth:`close` must run whatever the loop does.
    """

    def __init__(self) -> None:
        self.tracker = _Owners()
        self.counter = _Counter(self.tracker)
        self.tracker.__enter__()
        try:
            self.counter.__enter__()
        except BaseException:
            self.tracker.__exit__()
            raise

    def close(self) -> tuple[float, float]:
        try:
            self.counter.__exit__(None, None, None)
        finally:
            self.tracker.__exit__()
        total = float(self.counter.total)
        return total - self.counter.recomputed, total


def _tokens(tensors: list[torch.Tensor]) -> int | None:
    """Tokens of one loader's batch: its largest 2-D integer tensor (``input_ids``)."""
    ids = [t for t in tensors if t.ndim == 2 and not t.is_floating_point() and not t.is_complex()]
    return max((t.numel() for t in ids), default=None)


# --- bf16 on a CPU without native bf16 -------------------------------------------------------

#: The x86 instructions that compute bf16 natively; with neither, oneDNN emulates bf16.
_NATIVE_BF16_X86 = ("avx512_bf16", "amx_bf16")


def _native_bf16(platform: str, capabilities: Mapping[str, Any] | None) -> bool | None:
    """Whether a CPU computes bf16 natively, from its platform (``sys.platform``) and the
    capabilities torch reports (``torch.cpu.get_capabilities()``).

    True or False on Linux x86-64, where bf16 autocast was measured both ways; None
    (unknown, so no warning) on another platform or architecture, or when the
    capabilities do not mention the instructions.
    """
    if not platform.startswith("linux") or capabilities is None:
        return None
    if capabilities.get("architecture") != "x86_64":
        return None
    if not any(flag in capabilities for flag in _NATIVE_BF16_X86):
        return None
    return any(bool(capabilities.get(flag)) for flag in _NATIVE_BF16_X86)


def _cpuinfo_capabilities(cpuinfo: str, machine: str) -> dict[str, Any] | None:
    """What ``torch.cpu.get_capabilities()`` says of bf16, from Linux's ``/proc/cpuinfo``
    text and ``platform.machine()``: for a torch without that function. None when the
    text has no ``flags`` line."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags = set(value.split())
            return {"architecture": machine, **{f: f in flags for f in _NATIVE_BF16_X86}}
    return None


def _cpu_native_bf16() -> bool | None:
    """:func:`_native_bf16` for this machine, from torch's public
    ``torch.cpu.get_capabilities()`` (read once by torch, then cached), or, on a torch
    without it, from ``/proc/cpuinfo``. Tests replace this function to take either branch
    on any machine."""
    query = getattr(torch.cpu, "get_capabilities", None)
    if query is None:
        try:
            text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
        except OSError:
            return None
        return _native_bf16(sys.platform, _cpuinfo_capabilities(text, platform.machine()))
    try:
        capabilities = query()
    except RuntimeError:  # a CPU torch's cpuinfo could not read
        return None
    return _native_bf16(sys.platform, capabilities)


def _bf16_on_cpu_message(precision: str) -> str:
    return (
        f"SpeedMonitor: this run trains in {precision} on a CPU without native bf16 "
        f"instructions (no AVX512_BF16 or AMX_BF16), where bf16 is emulated and slower than "
        f"float32: on such a CPU (2 AVX2 cores), a training step of the kit's tiny example "
        f"VLM took 312 ms in bf16 autocast against 41 ms in float32, 8x slower "
        f"(benchmarks/cpu_step.py). Train in float32 on this CPU: "
        f"`Trainer(precision='32-true')`."
    )


# --- the callback ----------------------------------------------------------------------------

PeakSetting = float | Literal["auto", "measure"] | None


class SpeedMonitor(L.Callback):
    """Logs throughput, MFU, step-time percentiles, data wait and memory; needs no user input.

    Args:
        log_every_n_steps: log every this many training batches; defaults to the
            Trainer's ``log_every_n_steps``. Each log costs one small all-gather
            under DDP and, on CUDA, one wait for the device.
        window: step-time percentiles in the logs cover the last ``window`` steps
            (the summary covers the whole run).
        warmup_steps: batches left out of every figure at the start of each fit
            (start-up, allocator and cuDNN warm-up). 2 is enough for most models.
        flops_per_batch: ``batch -> FLOPs`` of one training step on one device,
            replacing the automatic count (e.g. a formula you trust). Used for
            both MFU and HFU.
        tokens_per_batch: ``batch -> tokens``. By default the largest 2-D integer
            tensor in the batch counts (e.g. ``input_ids``, padding included; with
            several train loaders, each loader's, summed); with none,
            ``tokens_per_sec`` is not logged.
        samples_per_batch: ``batch -> samples``; by default the first dimension
            of the first tensor in the batch, found through mappings (``dict``, Hugging
            Face's ``BatchEncoding``), lists, tuples and dataclasses, summed over the
            loaders' batches of a step with several train loaders. A batch with no
            tensor counts as one sample, and that is said once.
        peak_flops: dense peak FLOP/s of one device for MFU. ``"auto"`` (default)
            looks the device up in :data:`~lightning_speedkit.measure.peak.PEAK_TABLE`
            and, on CPU, times a matmul; ``"measure"`` always times a matmul; a
            number is used as given; None turns MFU and HFU off.
        max_flop_counts: how many distinct batch shapes get a real count; later
            shapes are estimated from those. Each count slows one step.

    Example::

        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[SpeedMonitor()], max_steps=0, logger=False)
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        window: int = 200,
        warmup_steps: int = 2,
        flops_per_batch: Callable[[Any], float] | None = None,
        tokens_per_batch: Callable[[Any], int] | None = None,
        samples_per_batch: Callable[[Any], int] | None = None,
        peak_flops: PeakSetting = "auto",
        max_flop_counts: int = 8,
    ) -> None:
        _validation.optional(_validation.positive_int, "log_every_n_steps", log_every_n_steps,
                             example=50)  # fmt: skip
        _validation.positive_int("window", window, example=200)
        _validation.non_negative_int("warmup_steps", warmup_steps, example=2)
        _validation.positive_int("max_flop_counts", max_flop_counts, example=8)
        for name, fn in (
            ("flops_per_batch", flops_per_batch),
            ("tokens_per_batch", tokens_per_batch),
            ("samples_per_batch", samples_per_batch),
        ):
            _validation.optional(_validation.function, name, fn,
                                 fix=f"for a constant, pass `lambda batch: {fn!r}`")  # fmt: skip
        if isinstance(peak_flops, str) and _validation.parse_number(peak_flops) is None:
            _validation.choice("peak_flops", peak_flops, ("auto", "measure"),
                               hint="or None, or a FLOP/s figure")  # fmt: skip
        elif peak_flops is not None:
            _validation.positive_number("peak_flops", peak_flops, example=989.4e12,
                                        hint="dense FLOP/s of one device")  # fmt: skip
        self.log_every_n_steps = log_every_n_steps
        self.window = window
        self.warmup_steps = warmup_steps
        self.flops_per_batch = flops_per_batch
        self.tokens_per_batch = tokens_per_batch
        self.samples_per_batch = samples_per_batch
        self.peak_flops = peak_flops
        self.max_flop_counts = max_flop_counts

        self.flops = _FlopBook()
        self.last_metrics: dict[str, float] = {}
        self._run: list[list[float]] = []  # per rank, _FIELDS sums over the whole run
        self._run_steps: list[float] = []  # this rank's step times (s), whole run
        self._recent: deque[float] = deque(maxlen=window)
        self._peak: float | None = None
        self._peak_warned = False
        self._bf16_warned = False
        self._device = torch.device("cpu")
        self._reset_fit_state()

    # -- state -------------------------------------------------------------------------------

    def _reset_fit_state(self) -> None:
        self._batches = 0
        self._said_samples = False
        self._interval = dict.fromkeys(_FIELDS, 0.0)
        self._info: _BatchInfo | None = None
        self._session: _FlopSession | None = None
        self._clock = StepClock(torch.device("cpu"))
        self._loaders: _combined.TrainLoaders | None = None  # None: one loader
        # Compiled parts: a count waits for a step that ran them compiled, compiling nothing.
        self._compiles: CompileWatch | None = None
        self._compiled_before = 0
        self._settled = True
        self._profiled_skips = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "run": [list(r) for r in self._run],
            "run_steps": list(self._run_steps),
            "flops": {k: vars(v) for k, v in self.flops.counted.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._run = [list(r) for r in state_dict.get("run", [])]
        self._run_steps = list(state_dict.get("run_steps", []))
        self.flops = _FlopBook()
        for key, counted in state_dict.get("flops", {}).items():
            self.flops.add(key, _Counted(**counted))

    # -- set-up ------------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # before Lightning restores a checkpoint's callback state
            self._run, self._run_steps = [], []
            self._recent.clear()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_compile_watch()
        self._reset_fit_state()
        self._device = device = trainer.strategy.root_device
        self._clock = StepClock(device)
        self._peak = self._resolve_peak(device, _compute_dtype(str(trainer.precision)))
        self._warn_bf16_on_cpu(device, str(trainer.precision))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if _compat.has_compiled_parts(pl_module):  # RegionalCompile's blocks, torch.compile
            self._compiles = CompileWatch().install()
            self._settled = False

    def _stop_compile_watch(self) -> None:
        if self._compiles is not None:
            self._compiles.remove()
            self._compiles = None

    def _warn_bf16_on_cpu(self, device: torch.device, precision: str) -> None:
        """Once per callback: bf16 (mixed or true) on a CPU known to lack native bf16."""
        if self._bf16_warned or device.type != "cpu" or not precision.startswith("bf16"):
            return
        if _cpu_native_bf16() is not False:  # native, or unknown: nothing to say
            return
        self._bf16_warned = True
        rank_zero_warn(_bf16_on_cpu_message(precision))

    def _resolve_peak(self, device: torch.device, dtype: torch.dtype) -> float | None:
        setting = self.peak_flops
        if setting is None:
            return None
        if isinstance(setting, (int, float)):
            return float(setting)
        if setting == "measure":
            return _peak.measure_matmul_peak(device, dtype)
        # "auto": the table; a CPU has no datasheet peak, so time a matmul there.
        found = _peak.peak_flops(device, dtype, measure=device.type == "cpu")
        if found is None and not self._peak_warned:
            self._peak_warned = True
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
            rank_zero_warn(
                f"SpeedMonitor: no peak FLOP/s is known for {name!r} at {dtype}, so `speed/mfu` "
                f"and `speed/hfu` are not logged. Pass `SpeedMonitor(peak_flops=<FLOP/s>)`, or "
                f"`peak_flops='measure'` to time a matmul."
            )
        return found

    # -- per batch: host metadata and events only ---------------------------------------------

    def _describe(self, batch: Any) -> _BatchInfo:
        # Several train loaders (a dict or list of them): the step trains each one's batch.
        parts = self._loaders.parts(batch) if self._loaders is not None else [batch]
        tensors = [list(_tensors(part)) for part in parts]
        signature = tuple((tuple(t.shape), str(t.dtype)) for each in tensors for t in each)
        if self.samples_per_batch is not None:
            samples = int(_number(self.samples_per_batch(batch), "samples_per_batch"))
        else:
            samples = sum(
                self._samples(part, found) for part, found in zip(parts, tensors, strict=True)
            )
        tokens: int | None
        if self.tokens_per_batch is not None:
            tokens = int(_number(self.tokens_per_batch(batch), "tokens_per_batch"))
        else:
            counts = [n for found in tensors if (n := _tokens(found)) is not None]
            tokens = sum(counts) if counts else None
        return _BatchInfo(signature, samples, tokens)

    def _samples(self, batch: Any, tensors: list[torch.Tensor]) -> int:
        """Samples of one loader's batch: the first dimension of its first tensor."""
        if tensors and tensors[0].ndim:
            return int(tensors[0].shape[0])
        if not self._said_samples:
            self._said_samples = True
            found = "holds no tensor" if not tensors else "starts with a 0-d tensor"
            rank_zero_warn(
                f"SpeedMonitor cannot tell how many samples a batch of type "
                f"`{type(batch).__name__}` holds (it {found}), so it counts one per batch: "
                f"samples/s and FLOPs per sample are off by the batch size. Pass "
                f"`SpeedMonitor(samples_per_batch=lambda batch: ...)`."
            )
        return 1

    def _drop_session(self) -> None:
        """Close a FLOP count whose batch never reached ``on_train_batch_end`` (the
        LightningModule's ``on_train_batch_start`` returned -1, or the loop stopped or
        failed mid-batch) and forget it: a count cut off is no count of that shape."""
        session, self._session = self._session, None
        if session is not None:  # never leave the dispatch mode and module hooks behind
            session.close()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._drop_session()
        self._clock.gap()
        loaders = _combined.of_trainer(trainer)  # built (or reloaded) by now
        self._loaders = loaders if loaders is not None and loaders.combined else None

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._drop_session()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._drop_session()  # validation is not part of the training step counted
        self._clock.gap()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._drop_session()  # the previous batch's, if its end hook never ran
        self._batches += 1
        self._info = info = self._describe(batch)
        if self._compiles is not None:
            self._compiled_before = self._compiles.compilations
        if self._counts(info.key):
            self._session = _FlopSession()
        self._clock.batch_start()

    def _counts(self, key: str) -> bool:
        """Whether this batch's step is the one to count FLOPs on."""
        if (
            self.flops_per_batch is not None
            or key in self.flops.counted
            or len(self.flops.counted) >= self.max_flop_counts
        ):
            return False
        if not self._settled:
            # Under the count, compiled blocks run eagerly: a step that would compile them
            # would compile nothing, and the compile would move to the next step, where
            # ProfilerSchedule (which waits for a step that compiles nothing) now profiles.
            return False
        if self._profiled_skips < _PROFILED_SKIPS and _compat.torch_profiler_enabled():
            # A profiled step would record every operator passing through the counter.
            self._profiled_skips += 1
            return False
        return True

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        info = self._info
        counted_now = self._session is not None
        # Samples and FLOPs count only with a timed step: the first batch after a gap
        # (a new epoch, validation) has no step time, and counting its samples would
        # overstate throughput by one batch per gap. Steps before the first FLOP count
        # (still compiling, or profiled) are start-up too: they would add samples and no FLOPs.
        priced = self.flops_per_batch is not None or bool(self.flops.counted)
        keep = self._clock.batch_end(
            not counted_now and priced and self._batches > self.warmup_steps
        )
        if self._session is not None and info is not None:
            model, hardware = self._session.close()
            self._session = None
            self.flops.add(info.key, _Counted(info.samples, info.tokens, model, hardware))
        if keep and info is not None:
            self._accumulate(info, batch)
        if self._compiles is not None and not counted_now:
            # Settled: a whole step ran the compiled parts and compiled nothing.
            self._settled = self._compiles.compilations == self._compiled_before
            if self._settled:
                self._stop_compile_watch()
        every = self.log_every_n_steps or _compat.log_every_n_steps(trainer)
        if self._batches % every == 0:
            self._flush(trainer)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._drop_session()
        self._stop_compile_watch()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._drop_session()
        self._flush(trainer)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._drop_session()
        self._stop_compile_watch()

    def _accumulate(self, info: _BatchInfo, batch: Any) -> None:
        acc = self._interval
        acc["samples"] += info.samples
        acc["tokens"] += info.tokens or 0
        acc["steps"] += 1
        if self.flops_per_batch is not None:
            flops = _number(self.flops_per_batch(batch), "flops_per_batch")
            acc["model_flops"] += flops
            acc["hw_flops"] += flops
            return
        estimate = self.flops.for_batch(info)
        if estimate is not None:
            acc["model_flops"] += estimate[0]
            acc["hw_flops"] += estimate[1]

    # -- log time: the only place that waits for the device or talks to other ranks ------------

    def _flush(self, trainer: L.Trainer) -> None:
        steps, waits = self._clock.drain()
        acc, self._interval = self._interval, dict.fromkeys(_FIELDS, 0.0)
        acc["time"] = sum(steps)
        acc["wait"] = sum(waits)
        acc["mem_gib"] = _memory_peak_gib(trainer.strategy.root_device)
        self._recent.extend(steps)
        self._run_steps.extend(steps)

        rows = self._gather(trainer, [acc[f] for f in _FIELDS])
        if len(self._run) != len(rows):
            self._run = [[0.0] * len(_FIELDS) for _ in rows]
        for run, row in zip(self._run, rows, strict=True):
            for i, field in enumerate(_FIELDS):
                run[i] = max(run[i], row[i]) if field == "mem_gib" else run[i] + row[i]
        metrics = self._figures(rows, list(self._recent))
        if metrics:
            self.last_metrics = metrics
            logged = {f"speed/{k}": v for k, v in metrics.items() if k != "flops_per_sample"}
            for logger in trainer.loggers:
                logger.log_metrics(logged, step=trainer.global_step)

    def _gather(self, trainer: L.Trainer, row: list[float]) -> list[list[float]]:
        if trainer.world_size == 1:
            return [row]
        local = torch.tensor(row, dtype=torch.float64, device=trainer.strategy.root_device)
        gathered = trainer.strategy.all_gather(local)  # collective: once per log interval
        return [list(map(float, r)) for r in gathered.reshape(trainer.world_size, -1).tolist()]

    def _figures(self, rows: list[list[float]], step_times: list[float]) -> dict[str, float]:
        col = {f: [r[i] for r in rows] for i, f in enumerate(_FIELDS)}
        if not all(t > 0 for t in col["time"]):
            return {}
        figures: dict[str, float] = {
            "samples_per_sec": sum(s / t for s, t in zip(col["samples"], col["time"], strict=True)),
            "data_wait_frac": statistics.fmean(
                w / t for w, t in zip(col["wait"], col["time"], strict=True)
            ),
        }
        if any(col["tokens"]):
            figures["tokens_per_sec"] = sum(
                k / t for k, t in zip(col["tokens"], col["time"], strict=True)
            )
        if any(col["model_flops"]):
            model_rate = statistics.fmean(
                f / t for f, t in zip(col["model_flops"], col["time"], strict=True)
            )
            hw_rate = statistics.fmean(
                f / t for f, t in zip(col["hw_flops"], col["time"], strict=True)
            )
            figures["tflops_per_device"] = model_rate / 1e12
            if self._peak:
                figures["mfu"] = model_rate / self._peak
                figures["hfu"] = hw_rate / self._peak
            if sum(col["samples"]):
                figures["flops_per_sample"] = sum(col["model_flops"]) / sum(col["samples"])
        if step_times:
            for q in (50, 90, 99):
                figures[f"step_ms_p{q}"] = 1e3 * _percentile(step_times, q)
        if any(col["mem_gib"]):
            figures["mem_peak_gib"] = max(col["mem_gib"])
        util = _gpu_util(self._device)
        if util is not None:
            figures["gpu_util"] = util
        if len(rows) > 1 and all(col["steps"]):
            means = [t / n for t, n in zip(col["time"], col["steps"], strict=True)]
            figures["straggler_ratio"] = max(means) / statistics.median(means)
        return figures

    @property
    def summary(self) -> dict[str, float | None]:
        """Figures for the whole run (the whole of the last fit, resumed parts included)."""
        figures = self._figures(self._run, self._run_steps) if self._run else {}
        return {key: figures.get(key) for key in SUMMARY_KEYS}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _compute_dtype(precision: str) -> torch.dtype:
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    if precision.startswith("64"):
        return torch.float64
    return torch.float32


def _memory_peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / _GIB  # allocator counter: no sync
    # CPU: the host memory now (sampled at each log; the run keeps the largest), read as
    # each platform allows. 0 where it tells nothing: the figure is then left out.
    held = host_memory_bytes()
    return held / _GIB if held is not None else 0.0


def _gpu_util(device: torch.device) -> float | None:
    if device.type != "cuda" or not NVML_AVAILABLE:
        return None
    import pynvml

    try:
        pynvml.nvmlInit()
        # By UUID: CUDA_VISIBLE_DEVICES renumbers devices for torch but not for NVML.
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = torch.cuda.get_device_properties(index).uuid
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu) / 100
    except (pynvml.NVMLError, AttributeError, RuntimeError, AssertionError):
        return None
