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
  profiler records is not counted either (up to 16 steps). Steps before the first
  count are left out of every figure, as warm-up is. Which step is counted, and the
  counts per shape, are :mod:`~lightning_speedkit.measure._flop_book`'s.
- **Samples** of a step are those of every train loader's batch in it: a dict or list
  of loaders (Lightning's CombinedLoader) trains one batch of each per step.
- **Tokens** per second are the real ones: padding that a batch marks (PackingCollate's
  ``document_ids``/``cu_seqlens``, an ``attention_mask``) is left out, counted on the
  device and read at log time. FLOPs are what ran: the count prices AttentionSwap's
  per-document attention calls on a packed batch, and padded positions in the linear
  layers. A packed batch's samples are its documents.
- **Time** on CPU is the host clock at the start and end of each batch. On CUDA it
  is a pair of CUDA events per batch, recorded without waiting and read once per
  log interval: the step time is the device time from the end of one batch to the
  end of the next, and **data wait** is the device's idle gap between the end of
  one batch and the start of the next (on CPU, the host's gap). Both include
  whatever else Lightning does between batches (checkpointing, for instance);
  validation and epoch boundaries are left out, and so are the steps of a
  ProfilerSchedule window (profiled steps run slower) and the step after each (its
  wait would hold the trace's writing and analysis, seconds). The arithmetic from these times to
  the figures is :mod:`~lightning_speedkit.measure._throughput`'s, which needs no
  Trainer and no clock.
- **Across ranks** one small ``all_gather`` per log interval sums samples/s over
  ranks and gives the straggler ratio (slowest rank's mean compute before the
  gradients' sync over the (lower) median's: the sync makes every rank's step time the
  slowest's). Nothing else crosses ranks, and per-step hooks never synchronise the
  device.

Logged where Lightning writes its own rows (the Trainer's ``log_every_n_steps``, in
optimizer steps), at their step, or every ``log_every_n_steps`` batches given here,
through the Trainer's loggers, under ``speed/``: ``samples_per_sec``,
``tokens_per_sec``, ``tflops_per_device``, ``mfu``, ``hfu``, ``step_ms_p50``,
``step_ms_p90``, ``step_ms_p99``, ``data_wait_frac``, ``mem_peak_gib``,
``gpu_util`` (NVIDIA, with nvidia-ml-py) and ``straggler_ratio`` (DDP). A figure
that cannot be known (MFU on a device without a known peak) is left out, never
logged as 0.

At fit start it also warns, once, when the run trains in bf16 (mixed or true) on a
CPU without native bf16 instructions (Linux x86-64 with neither AVX512_BF16 nor
AMX_BF16, as torch reports them), where bf16 is emulated and several times slower
than float32. At the end of a fit's first packed batch (``cu_seqlens``/``document_ids``)
it warns when no attention was swapped to keep the batch's documents apart (no
AttentionSwap, no ``swap_attention``): every token then attends across the documents of
its row (:mod:`~lightning_speedkit.measure._packed_check`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_speedkit import _combined, _compat, _validation
from lightning_speedkit._imports import NVML_AVAILABLE
from lightning_speedkit._loggers import log_metrics
from lightning_speedkit.measure import _cpu_bf16
from lightning_speedkit.measure import peak as _peak
from lightning_speedkit.measure._batch_info import BatchInfo, BatchReader
from lightning_speedkit.measure._clock import StepClock
from lightning_speedkit.measure._compile_watch import CompileWatch
from lightning_speedkit.measure._flop_book import CountSchedule, FlopBook, step_flops
from lightning_speedkit.measure._host_memory import host_memory_bytes
from lightning_speedkit.measure._packed_check import PackedCheck
from lightning_speedkit.measure._profiler_windows import window_open
from lightning_speedkit.measure._throughput import Throughput

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

_GIB = 2**30

PeakSetting = float | Literal["auto", "measure"] | None


class SpeedMonitor(L.Callback):
    """Logs throughput, MFU, step-time percentiles, data wait and memory; needs no user input.

    Args:
        log_every_n_steps: log every this many training batches; by default with
            Lightning's own rows (every ``log_every_n_steps`` optimizer steps of the
            Trainer's, at the batch that steps). Each log costs one small all-gather
            under DDP and, on CUDA, one wait for the device.
        window: step-time percentiles in the logs cover the last ``window`` steps
            (the summary covers the whole run).
        warmup_steps: batches left out of every figure at the start of each fit
            (start-up, allocator and cuDNN warm-up). 2 is enough for most models.
        flops_per_batch: ``batch -> FLOPs`` of one training step on one device,
            replacing the automatic count (e.g. a formula you trust). Used for
            both MFU and HFU.
        tokens_per_batch: ``batch -> tokens``. By default ``tokens_per_sec`` counts the
            real tokens: where a batch marks its padding (a packed batch's
            ``document_ids`` or ``cu_seqlens``, else an ``attention_mask`` shaped as the
            tokens) the tokens that are not padding, counted on the device and read at
            log time; otherwise the size of its largest 2-D integer tensor
            (``input_ids``). ``labels`` of -100 are not read: a prompt the loss ignores
            still ran. With several train loaders, each loader's, summed; with no
            integer tensor, ``tokens_per_sec`` is not logged. Your function replaces both
            this and the token positions the FLOP estimate goes by.
        samples_per_batch: ``batch -> samples``; by default a packed batch's documents
            (``len(cu_seqlens) - 1``), else the first dimension of the first tensor in
            the batch, found through mappings (``dict``, Hugging Face's
            ``BatchEncoding``), lists, tuples and dataclasses, summed over the loaders'
            batches of a step with several train loaders. A batch with no tensor counts
            as one sample, and that is said once.
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
        _check_arguments(log_every_n_steps, window, warmup_steps, max_flop_counts, peak_flops,
                         flops_per_batch, tokens_per_batch, samples_per_batch)  # fmt: skip
        self.log_every_n_steps = log_every_n_steps
        self.window = window
        self.warmup_steps = warmup_steps
        self.flops_per_batch = flops_per_batch
        self.tokens_per_batch = tokens_per_batch
        self.samples_per_batch = samples_per_batch
        self.peak_flops = peak_flops
        self.max_flop_counts = max_flop_counts
        self.flops = FlopBook()
        self.last_metrics: dict[str, float] = {}
        self._throughput = Throughput(window)
        self._peak: float | None = None
        self._peak_warned = self._bf16_warned = False
        self._device = torch.device("cpu")
        self._packed = PackedCheck()  # packed batches' documents kept apart (said once)
        self._reset_fit_state()

    def _reset_fit_state(self) -> None:
        self._batches = 0
        self._reader = BatchReader(self.samples_per_batch, self.tokens_per_batch)
        self._info: BatchInfo | None = None
        max_counts = 0 if self.flops_per_batch is not None else self.max_flop_counts
        self._counts = CountSchedule(self.flops, max_counts)
        self._clock = StepClock(torch.device("cpu"), untimed=window_open)
        self._loaders: _combined.TrainLoaders | None = None  # None: one loader

    def state_dict(self) -> dict[str, Any]:
        return {**self._throughput.state_dict(), "flops": self.flops.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._throughput.load_state_dict(state_dict)
        self.flops.load_state_dict(state_dict.get("flops", {}))

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # before Lightning restores a checkpoint's callback state
            self._throughput.reset()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._counts.close()
        self._reset_fit_state()
        self._device = device = trainer.strategy.root_device
        self._clock = StepClock(device, untimed=window_open)  # ProfilerSchedule's windows
        precision = str(trainer.precision)
        self._peak = _resolve_peak(self.peak_flops, device, _compute_dtype(precision))
        if self._peak is None and self.peak_flops == "auto" and not self._peak_warned:
            self._peak_warned = _warn(_no_peak_message(device, _compute_dtype(precision)))
        if not self._bf16_warned and _cpu_bf16.emulated_bf16(device, precision):
            self._bf16_warned = _warn(_cpu_bf16.bf16_on_cpu_message(precision))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if _compat.has_compiled_parts(pl_module):  # RegionalCompile's blocks, torch.compile
            self._counts.watch(CompileWatch().install())

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._counts.drop()
        self._clock.gap()
        loaders = _combined.of_trainer(trainer)  # built (or reloaded) by now
        self._loaders = loaders if loaders is not None and loaders.combined else None

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._counts.drop()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._counts.drop()  # validation is not part of the training step counted
        self._clock.gap()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._counts.drop()  # the previous batch's, if its end hook never ran
        self._batches += 1
        _reset_memory_peak(self._device, self._batches)
        # several train loaders (a dict or list of them): the step trains each one's batch
        parts = self._loaders.parts(batch) if self._loaders is not None else [batch]
        self._info = info = self._reader.read(batch, parts)
        self._packed.start(info, pl_module)
        self._counts.step_start(info)
        self._clock.batch_start()

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Samples and FLOPs count only with a timed step: the first batch after a gap
        (a new epoch, validation) has no step time, and counting its samples would
        overstate throughput by one batch per gap. Steps before the first FLOP count
        (still compiling, or profiled) are start-up too: they would add samples and no
        FLOPs. A counted step is slower, so it is not timed either, nor one that compiled
        (a recompilation, at any step); nor is a step of a ProfilerSchedule window, nor
        the step after one (the clock's ``untimed``)."""
        info, counted = self._info, self._counts.untimed
        priced = self.flops_per_batch is not None or bool(self.flops.counted)
        keep = self._clock.batch_end(priced and not counted and self._batches > self.warmup_steps)
        if info is not None:
            self._counts.step_end(info)
        self._packed.end(info, trainer, pl_module)  # the fit's first packed batch only
        if keep and info is not None:
            flops = step_flops(info, batch, self.flops, self.flops_per_batch, self._counts.served)
            real = info.throughput_tokens  # padding left out where the batch marks it
            self._throughput.update(samples=info.samples, tokens=real, flops=flops)
        every = self.log_every_n_steps  # else at Lightning's rows, with them
        if (self._batches % every == 0) if every else _compat.lightning_logs_now(trainer):
            self._flush(trainer)

    def on_before_backward(self, *args: Any) -> None:
        self._clock.backward_start()  # the compute that tells DDP's ranks apart ends

    def on_exception(self, *args: Any) -> None:
        self._counts.close()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._counts.drop()
        self._flush(trainer)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._counts.close()
        self._packed.close()  # a batch that never ended (a failed step): its hooks go

    # -- log time: the only place that waits for the device or talks to other ranks ------------

    def _flush(self, trainer: L.Trainer) -> None:
        steps, waits, computes = self._clock.drain()
        memory = _memory_peak_gib(trainer.strategy.root_device)
        row = self._throughput.close(step_times=steps, waits=waits, mem_gib=memory,
                                     computes=computes)  # fmt: skip
        rows = _gather(trainer, row)
        self._throughput.add(rows)
        metrics = self._throughput.compute(rows, self._peak, lambda: _gpu_util(self._device))
        if metrics:
            self.last_metrics = metrics
            log_metrics(trainer, {f"speed/{k}": v for k, v in metrics.items()
                                  if k != "flops_per_sample"})  # fmt: skip

    @property
    def summary(self) -> dict[str, float | None]:
        """Figures for the whole run (the whole of the last fit, resumed parts included)."""
        figures = self._throughput.summary(self._peak, lambda: _gpu_util(self._device))
        return {key: figures.get(key) for key in SUMMARY_KEYS}


def _check_arguments(
    log_every_n_steps: int | None,
    window: int,
    warmup_steps: int,
    max_flop_counts: int,
    peak_flops: PeakSetting,
    *functions: Callable[[Any], float] | None,
) -> None:
    """SpeedMonitor's arguments, each checked (``functions``: the three per-batch ones)."""
    _validation.optional(_validation.positive_int, "log_every_n_steps", log_every_n_steps,
                         example=50)  # fmt: skip
    _validation.positive_int("window", window, example=200)
    _validation.non_negative_int("warmup_steps", warmup_steps, example=2)
    _validation.positive_int("max_flop_counts", max_flop_counts, example=8)
    names = ("flops_per_batch", "tokens_per_batch", "samples_per_batch")
    for name, fn in zip(names, functions, strict=True):
        _validation.optional(_validation.function, name, fn,
                             fix=f"for a constant, pass `lambda batch: {fn!r}`")  # fmt: skip
    if isinstance(peak_flops, str) and _validation.parse_number(peak_flops) is None:
        _validation.choice("peak_flops", peak_flops, ("auto", "measure"),
                           hint="or None, or a FLOP/s figure")  # fmt: skip
    elif peak_flops is not None:
        _validation.positive_number("peak_flops", peak_flops, example=989.4e12,
                                    hint="dense FLOP/s of one device")  # fmt: skip


def _warn(message: str) -> bool:
    """Warn (rank 0) and say so: ``self._warned = _warn(...)``."""
    rank_zero_warn(message)
    return True


#: Peaks timed in this process, by device, dtype, torch's thread count and float32 matmul
#: precision: every fit of a process divides by the same peak (a 0.3 s matmul timed anew
#: per fit moved 2x between fits on a busy machine).
_TIMED_PEAKS: dict[tuple[str, torch.dtype, int, str], float | None] = {}


def _resolve_peak(setting: PeakSetting, device: torch.device, dtype: torch.dtype) -> float | None:
    """The peak FLOP/s ``SpeedMonitor(peak_flops=setting)`` uses on ``device`` at ``dtype``."""
    if setting is None:
        return None
    if isinstance(setting, (int, float)):
        return float(setting)
    if setting == "auto" and device.type != "cpu":
        return _peak.peak_flops(device, dtype)  # the table; a CPU has no datasheet peak
    key = (str(device), dtype, torch.get_num_threads(), torch.get_float32_matmul_precision())
    if key not in _TIMED_PEAKS:  # a CPU has no datasheet: "auto" and "measure" time alike
        cpu = device.type == "cpu"
        _TIMED_PEAKS[key] = (_peak.peak_flops(device, dtype, measure=True) if cpu
                             else _peak.measure_matmul_peak(device, dtype))  # fmt: skip
    return _TIMED_PEAKS[key]


def _no_peak_message(device: torch.device, dtype: torch.dtype) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return (
        f"SpeedMonitor: no peak FLOP/s is known for {name!r} at {dtype}, so `speed/mfu` "
        f"and `speed/hfu` are not logged. Pass `SpeedMonitor(peak_flops=<FLOP/s>)`, or "
        f"`peak_flops='measure'` to time a matmul."
    )


def _gather(trainer: L.Trainer, row: list[float]) -> list[list[float]]:
    """Every rank's row, in rank order (one small collective per log interval)."""
    if trainer.world_size == 1:
        return [row]
    local = torch.tensor(row, dtype=torch.float64, device=trainer.strategy.root_device)
    gathered = trainer.strategy.all_gather(local)  # collective: once per log interval
    return [list(map(float, r)) for r in gathered.reshape(trainer.world_size, -1).tolist()]


def _compute_dtype(precision: str) -> torch.dtype:
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    if precision.startswith("64"):
        return torch.float64
    return torch.float32


def _reset_memory_peak(device: torch.device, batch: int) -> None:
    """At the fit's first batch: its peak is not an earlier fit's, nor a tuner's trials."""
    if batch == 1 and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # allocator counter: no sync


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
