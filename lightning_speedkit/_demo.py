"""``speedkit demo``: train the example VLM and report how fast it went and what it learned."""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_speedkit import _compat
from lightning_speedkit.attention import AttentionSwap
from lightning_speedkit.compute import FusedOptimizer, RegionalCompile
from lightning_speedkit.data import NumWorkersTuner, SampleCache, SpeedDataModuleMixin
from lightning_speedkit.distributed import DDPPowerSGDStrategy
from lightning_speedkit.measure import ProfilerSchedule, SpeedMonitor
from lightning_speedkit.measure.peak import measure_matmul_peak
from lightning_speedkit.measure.speed_monitor import PeakSetting
from lightning_speedkit.schedule import AccumulationScheduler, accumulation_for
from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule, VLMTask
from speedkit_examples.vlm.data import Batch

POWERSGD_RANK = 4
"""The kit's PowerSGD rank with several devices: on two CPU processes rank 1 (the
strategy's default) left the tiny VLM, trained with AdamW, on its caption-only plateau
in every seed tried, rank 2 part of the way; rank 4 ends where plain DDP does
(``benchmarks/powersgd_rank.py``)."""


@dataclass(frozen=True)
class DemoConfig:
    """What ``speedkit demo`` trains. Each field is a command-line flag of the same name
    (``--batch-size`` for ``batch_size``; ``--only`` picks one of ``runs``), except
    ``warmup_steps`` and ``log_every_n_steps``, which only callers of ``run_demo`` set."""

    steps: int = 1500
    """Optimizer steps of each run (plain, then kit)."""
    size: str = "tiny"
    accelerator: str = "auto"
    devices: int = 1
    precision: str = "32-true"
    batch_size: int = 32
    global_batch: int | None = None
    """Samples per optimizer step over all devices (None: one batch per step)."""
    num_workers: int = 0
    """DataLoader workers of the plain run (the kit run tunes its own)."""
    data_dir: str | None = None
    output_dir: str = "speedkit_runs/demo"
    seed: int = 0
    warmup_steps: int = 10
    """Steps left out of the speed figures (start-up, allocator warm-up)."""
    log_every_n_steps: int = 50
    runs: tuple[str, ...] = ("plain", "kit")
    """Which runs to do: the plain Lightning baseline and/or the kit."""


@dataclass
class DemoResult:
    """One training run's figures; the speed figures are SpeedMonitor's summary.

    A figure that could not be measured (MFU without a known peak, speeds of a run
    shorter than its warm-up) is None, and the table shows "n/a".
    """

    run: str
    notes: list[str]
    size: str
    params: int
    devices: int
    steps: int
    samples_per_sec: float | None
    mfu: float | None
    data_wait_frac: float | None
    step_ms_p50: float | None
    step_ms_p90: float | None
    step_ms_p99: float | None
    mem_peak_gib: float | None
    loss_start: float
    loss_end: float
    val_loss: float
    val_acc: float
    wall_sec: float

    def rows(self) -> list[tuple[str, str]]:
        return [
            ("model", f"{self.size} ({self.params / 1e6:.2f} M parameters)"),
            ("devices", str(self.devices)),
            ("steps", str(self.steps)),
            ("samples/s", _fmt(self.samples_per_sec, ",.1f")),
            ("MFU", _fmt(self.mfu, ".1%")),
            ("data wait (share of step)", _fmt(self.data_wait_frac, ".1%")),
            ("step time p50 (ms)", _fmt(self.step_ms_p50, ".1f")),
            ("step time p90 (ms)", _fmt(self.step_ms_p90, ".1f")),
            ("step time p99 (ms)", _fmt(self.step_ms_p99, ".1f")),
            ("peak memory (GiB)", _fmt(self.mem_peak_gib, ".2f")),
            ("train loss, first steps", f"{self.loss_start:.3f}"),
            ("train loss, last steps", f"{self.loss_end:.3f}"),
            ("held-out loss", f"{self.val_loss:.3f}"),
            ("held-out token accuracy", f"{self.val_acc:.1%}"),
            ("wall time (s)", f"{self.wall_sec:.1f}"),
        ]


def comparison_table(results: list[DemoResult]) -> str:
    """The runs side by side, with the kit's speed-up when both ran."""
    names = [r.run for r in results]
    columns = [dict(r.rows()) for r in results]
    keys = [k for k, _ in results[0].rows()]
    width = max(len(k) for k in keys)
    col = max(12, *(len(v) for c in columns for v in c.values()))
    lines = [f"{'':<{width}}  " + "  ".join(f"{n:>{col}}" for n in names)]
    lines += [f"{k:<{width}}  " + "  ".join(f"{c[k]:>{col}}" for c in columns) for k in keys]
    by_name = {r.run: r for r in results}
    plain, kit = by_name.get("plain"), by_name.get("kit")
    if plain and kit and plain.samples_per_sec and kit.samples_per_sec:
        lines.append(f"\nkit / plain samples/s: {kit.samples_per_sec / plain.samples_per_sec:.2f}x")
        lines.append(
            "(the runs follow each other; on a shared machine identical runs differ by up to 10%)"
        )
        splits = [(r.run, split) for r in results if (split := time_per_sample(r)) is not None]
        if len(splits) == len(results):
            lines.append("where a sample's time went (µs per sample = data wait + compute):")
            for run, (total, data, compute) in splits:
                lines.append(f"  {run:<6} {total:>7,.0f} = {data:>6,.0f} + {compute:>7,.0f}")
            lines.append(
                "(compute: forward, backward, optimizer step and the loop; a loader can "
                "only remove the data wait)"
            )
    for r in results:
        lines += r.notes
    return "\n".join(lines)


def time_per_sample(result: DemoResult) -> tuple[float, float, float] | None:
    """A run's time per sample in µs, split as (total, data wait, the rest).

    The rest is the model's compute (forward, backward, optimizer step) and the loop's
    own time: what no loader can take away. None when a figure is missing.
    """
    speed, wait = result.samples_per_sec, result.data_wait_frac
    if not speed or wait is None:
        return None
    total = 1e6 / speed
    return total, total * wait, total * (1 - wait)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


class _LossTrace(L.Callback):
    """Each optimizer step's loss, kept on the device and read once when the run ends.

    Lightning hands ``on_train_batch_end`` a micro-batch's loss divided by the
    accumulation factor (what backward saw); their sum over a step is the step's loss,
    however the global batch was cut into micro-batches (the kit's MicroBatchTuner may
    cut it differently from the plain run).
    """

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self._window: torch.Tensor | None = None
        self._step = 0

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not (isinstance(outputs, dict) and "loss" in outputs):
            return
        loss = outputs["loss"].detach()
        self._window = loss if self._window is None else self._window + loss
        if trainer.global_step != self._step:  # this batch closed an optimizer step
            self._step = trainer.global_step
            self.losses.append(self._window)
            self._window = None


class _CacheAtStart(L.Callback):
    """How many samples the kit's cache held when training began, and how they got there.

    The tuner's trials read through the cache in this process before the warm-up fills
    the rest, so the cache's miss count at the end mixes reads made before the first
    step with reads made during training; this takes the count apart at the first step.
    """

    def __init__(self) -> None:
        self.misses: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        cache = getattr(_compat.datamodule(trainer), "sample_cache", None)
        self.misses = cache.misses if cache is not None else None


def cache_note(cache: SampleCache, misses_at_start: int | None) -> str:
    """The demo's line on the kit's sample cache: what was decoded before the first step
    (by the warm-up's workers, by the tuner's trials in this process) and during training.

    Example::

        >>> cache = SampleCache(list(range(10)))
        >>> cache.warmed, cache.misses, cache.hits, cache.nbytes = 6, 4, 30, 2**20
        >>> note = cache_note(cache, misses_at_start=4)
        >>> for part in note.split("): ")[1].split(", "):
        ...     print(part)
        10 in memory before the first step (6 decoded by the warm-up's workers
        4 by the tuner's trials in this process)
        0 read during training
        30 served from memory (1 MiB)
    """
    before = cache.warmed + (misses_at_start or 0)
    during = cache.misses - (misses_at_start or 0)
    how = f"{cache.warmed:,} decoded by the warm-up's workers"
    if misses_at_start:
        how += f", {misses_at_start:,} by the tuner's trials in this process"
    return (
        f"kit: SampleCache: decoded samples kept in memory (same data, same order): "
        f"{before:,} in memory before the first step ({how}), {during:,} read during "
        f"training, {cache.hits:,} served from memory ({cache.nbytes / 2**20:.0f} MiB)"
    )


class _KitVLMData(SpeedDataModuleMixin, VLMDataModule):
    """The example's DataModule with the kit's loader: tuned workers, decoded samples cached.

    The example decodes a JPEG, resizes it and tokenizes its caption for every sample
    of every epoch; the corpus is small enough (4,096 samples: 49 MiB decoded at 32
    pixels, 2.4 GiB at 224) to keep. Same samples, same order: the loss does not
    change. The cache is kept where loading runs in the training process, and warmed
    before the first step by worker processes (on 2 cores: 0.9 s, against the first
    epoch's decoding one sample after another between steps); loader workers (what the
    tuner picks when it has cores to give) would each hold their own copy, so with
    workers the loader goes uncached. The cache is warmed only once the tuner has chosen
    in-process loading: worker candidates forked from a warm cache would be timed at the
    cache's speed, not at the uncached speed they would run at.
    """

    sample_cache: SampleCache | None = None
    cache_bytes = 4 * 2**30

    def train_dataloader(self) -> DataLoader[Batch]:
        tuned = getattr(self, "speed_loader_kwargs", None) or {}
        in_process = tuned.get("num_workers", self.num_workers) == 0
        dataset = self.datasets["train"]
        loader = self.speed_dataloader(
            dataset, batch_size=self.batch_size, sampler=self.shuffle_sampler(dataset),
            drop_last=True, collate_fn=self.collate,
            cache=self.cache_bytes if in_process else False,
            warm_cache=in_process and bool(tuned),  # not for the tuner's trials: see above
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
        )  # fmt: skip
        cached = loader.dataset
        self.sample_cache = cached if isinstance(cached, SampleCache) else None
        return loader


@dataclass
class _Kit:
    """The kit run's callbacks, each a lever that keeps the run's numerics.

    The loader (tuned workers, decoded samples cached), the compute (fused attention,
    a fused optimizer, compiled blocks on CUDA) and one profiled window with its report.
    A lever is in the kit where it was measured to pay at the demo's shapes. Plain
    Lightning runs with none. MicroBatchTuner is left out: the example's loss is a mean
    over each micro-batch's caption tokens, so cutting the global batch otherwise weighs
    tokens otherwise (first-step loss 3.581 against 3.584 at 4 x 8 vs plain's cut): a
    change of numerics, however small.
    """

    tuner: NumWorkersTuner
    profiler: ProfilerSchedule
    compile: RegionalCompile | None
    """None on CPU (see the note it leaves)."""
    fused: FusedOptimizer
    accumulation: AccumulationScheduler | None
    """With a global batch: the same micro-batches per optimizer step as plain's."""
    swap: AttentionSwap
    cache_at_start: _CacheAtStart = field(default_factory=_CacheAtStart)
    """Not a lever: where the cache's samples came from (the notes)."""

    @classmethod
    def build(cls, config: DemoConfig, on_cuda: bool) -> _Kit:
        # The profiler counts batches: with a global batch, several per optimizer step.
        batches = config.steps * (
            1
            if config.global_batch is None
            else accumulation_for(config.global_batch, config.batch_size, config.devices)
        )
        return cls(
            tuner=NumWorkersTuner(progress=False),
            profiler=ProfilerSchedule(
                skip_first=max(batches - 4, 0),  # the last batches: the figures stay clean
                wait=0,
                warmup=1,
                active=3,
                repeat=1,
                dirpath=Path(config.output_dir) / "kit" / "profiler",
            ),
            compile=RegionalCompile(verbose=False) if on_cuda else None,
            fused=FusedOptimizer(verbose=False),
            accumulation=None
            if config.global_batch is None
            else AccumulationScheduler(
                target_global_batch=config.global_batch,
                micro_batch_size=config.batch_size,
                verbose=False,
            ),
            swap=AttentionSwap(verbose=False),
        )

    def callbacks(self) -> list[L.Callback]:
        optional = (self.accumulation, self.compile)
        levers: list[L.Callback] = [lever for lever in optional if lever is not None]
        return [self.swap, *levers, self.fused, self.tuner, self.profiler]

    def notes(self, config: DemoConfig) -> list[str]:
        """What each lever did, one line each."""
        notes = []
        result = self.tuner.result
        if result is not None:
            best = result.best
            notes.append(
                f"kit: NumWorkersTuner chose num_workers={best['num_workers']}"
                + (f", prefetch_factor={best['prefetch_factor']}" if best["num_workers"] else "")
                + (" (the loader as given)" if best["num_workers"] == config.num_workers else "")
            )
        swap = self.swap.report
        swapped = len(swap.swapped) if swap is not None else 0
        reverted = len(swap.reverted) if swap is not None else 0
        notes.append(
            f"kit: AttentionSwap: {swapped} attention modules on a fused kernel"
            + (f", {reverted} kept their own (parity)" if reverted else "")
            + "; not bitwise equal to the eager attention, so the loss drifts from "
            "plain's by training noise"
        )
        if self.compile is not None:
            watch = self.compile.watch
            notes.append(
                f"kit: RegionalCompile: {len(self.compile.compiled)} blocks compiled in place, "
                f"{watch.graphs} graphs, {watch.recompiles} recompiles, {watch.seconds:.1f} s "
                f"compiling (in the wall time, not in samples/s)"
            )
        else:
            notes.append(
                "kit: RegionalCompile left out on CPU: the tiny VLM's compiled blocks ran "
                "slower than eager on 2 cores (benchmarks/cpu_step.py; docs/benchmarks.md)"
            )
        kernels = sorted({s.implementation or "unchanged" for s in self.fused.switched})
        notes.append(f"kit: FusedOptimizer: AdamW on its {', '.join(kernels) or 'own'} kernel")
        report = self.profiler.report
        if report is not None:
            kinds = ", ".join(report.kinds) or "nothing stands out"
            notes.append(f"kit: profiled window: {kinds}; report {self.profiler.report_files[0]}")
            notes += [f"  - {f.kind}: {f.fix}" for f in report.findings]
        return notes


def _train(config: DemoConfig, run: str, peak: PeakSetting) -> DemoResult | None:
    """One run of the example VLM; ``run`` is "plain" (Lightning as it is) or "kit"."""
    L.seed_everything(config.seed, workers=True, verbose=False)
    tokenizer = CaptionTokenizer()
    model_cfg = VLMConfig.preset(config.size, tokenizer.vocab_size)  # type: ignore[arg-type]
    data_class = _KitVLMData if run == "kit" else VLMDataModule
    datamodule = data_class.for_model(
        model_cfg, config.data_dir, batch_size=config.batch_size, num_workers=config.num_workers
    )
    task = VLMTask(model_cfg, pad_id=tokenizer.pad_id)
    on_cuda = runs_on_cuda(config.accelerator)
    kit = _Kit.build(config, on_cuda) if run == "kit" else None
    # Both runs take optimizer steps of the same global batch: plain Lightning through its
    # own accumulate_grad_batches, the kit through AccumulationScheduler.
    accumulation = 1
    if config.global_batch is not None:
        accumulation = accumulation_for(config.global_batch, config.batch_size, config.devices)
    strategy: str | DDPPowerSGDStrategy = "auto"
    if config.devices > 1:  # several processes: DDP, and the kit compresses its gradients
        strategy = DDPPowerSGDStrategy(rank=POWERSGD_RANK) if run == "kit" else "ddp"
    fitted = fit_and_measure(
        config,
        run,
        task,
        datamodule,
        peak,
        callbacks=[*kit.callbacks(), kit.cache_at_start] if kit is not None else [],
        strategy=strategy,
        accumulate_grad_batches=accumulation if run == "plain" else 1,
    )
    if fitted is None:
        return None
    result, trainer = fitted
    notes = kit.notes(config) if kit is not None else []
    if isinstance(datamodule, _KitVLMData):
        cache = datamodule.sample_cache
        if cache is not None:
            misses_at_start = kit.cache_at_start.misses if kit is not None else None
            notes.append(cache_note(cache, misses_at_start))
        else:
            notes.append(
                "kit: SampleCache left off: the tuned loader decodes in worker processes, "
                "each of which would keep its own copy"
            )
    if isinstance(strategy, DDPPowerSGDStrategy):
        state = strategy.powersgd_state
        sent = state.total_numel_after_compression if state is not None else 0
        compressed = (
            f"{state.total_numel_before_compression / sent:.1f}x fewer elements sent"
            if state is not None and sent
            else f"nothing compressed yet: PowerSGD starts after {strategy.start_iter} steps"
        )
        notes.append(
            f"kit: gradients all-reduced with PowerSGD at rank {POWERSGD_RANK}, {compressed} "
            f"(DDPPowerSGDStrategy(rank={POWERSGD_RANK}); at its default rank 1 this model, "
            "trained with AdamW, stays on its caption-only plateau)"
        )
    if accumulation > 1:
        who = "AccumulationScheduler" if run == "kit" else "accumulate_grad_batches"
        notes.append(
            f"{run}: {who}: {accumulation} batches of {config.batch_size} on "
            f"{trainer.world_size} device(s) per optimizer step "
            f"(global batch {accumulation * config.batch_size * trainer.world_size})"
        )
    result.notes = notes
    return result


def runs_on_cuda(accelerator: str) -> bool:
    """Whether Lightning's ``accelerator`` argument puts training on a CUDA device."""
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def shared_peak(accelerator: str, precision: str) -> PeakSetting:
    """One CPU peak for all the runs compared, timed once (longer than SpeedMonitor's
    default) in the runs' matmul dtype, so that their MFU share a denominator; on CUDA
    the device's table ("auto")."""
    if runs_on_cuda(accelerator):
        return "auto"
    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    return measure_matmul_peak("cpu", dtype, seconds=1.0)


def fit_and_measure(
    config: DemoConfig,
    run: str,
    task: VLMTask,
    datamodule: L.LightningDataModule,
    peak: PeakSetting,
    *,
    callbacks: list[L.Callback],
    strategy: Any = "auto",
    accumulate_grad_batches: int = 1,
) -> tuple[DemoResult, L.Trainer] | None:
    """Train ``task`` for ``config.steps`` steps, then one held-out pass; its figures.

    The yardstick every run of the demo (and ``benchmarks/hand_tuned.py``) is measured
    with: SpeedMonitor's summary, the loss of the first and last steps, the held-out
    loss and accuracy, the wall time of ``fit`` (compilation included). Returns the
    result (with no notes) and the trainer on rank 0, else None.
    """
    trace = _LossTrace()
    monitor = SpeedMonitor(
        warmup_steps=config.warmup_steps,
        log_every_n_steps=config.log_every_n_steps,
        peak_flops=peak,
    )
    trainer = L.Trainer(
        accumulate_grad_batches=accumulate_grad_batches,
        accelerator=config.accelerator,
        devices=config.devices,
        strategy=strategy,
        precision=config.precision,  # type: ignore[arg-type]
        max_steps=config.steps,
        limit_val_batches=0,  # one held-out pass after training, below
        logger=CSVLogger(Path(config.output_dir), name=run),
        callbacks=[monitor, trace, *callbacks],
        enable_checkpointing=False,
        log_every_n_steps=config.log_every_n_steps,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(task, datamodule=datamodule)
    wall = time.perf_counter() - start
    trainer.limit_val_batches = 1.0
    (metrics,) = trainer.validate(task, datamodule=datamodule, verbose=False)
    if trainer.global_rank != 0:
        return None
    speed = monitor.summary
    losses = torch.stack(trace.losses).float().cpu().tolist()  # one read at the end of the run
    head = max(1, min(10, len(losses) // 10))
    tail = max(1, len(losses) // 10)
    result = DemoResult(
        run=run,
        notes=[],
        size=config.size,
        params=sum(p.numel() for p in task.model.parameters()),
        devices=trainer.world_size,
        steps=trainer.global_step,
        samples_per_sec=speed["samples_per_sec"],
        mfu=speed["mfu"],
        data_wait_frac=speed["data_wait_frac"],
        step_ms_p50=speed["step_ms_p50"],
        step_ms_p90=speed["step_ms_p90"],
        step_ms_p99=speed["step_ms_p99"],
        mem_peak_gib=speed["mem_peak_gib"],
        loss_start=statistics.fmean(losses[:head]),
        loss_end=statistics.fmean(losses[-tail:]),
        val_loss=float(metrics["val/loss"]),
        val_acc=float(metrics["val/acc"]),
        wall_sec=wall,
    )
    return result, trainer


class _DropLightningTip(logging.Filter):
    """Lightning's advertisement for its cloud logger, printed at every Trainer's start."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


@contextlib.contextmanager
def _quiet_third_party() -> Iterator[None]:
    """Leave out of the demo's output what its user cannot act on: Lightning's tip, and
    the FutureWarning that Lightning's own code draws from torch about ``LeafSpec``."""
    tip = _DropLightningTip()
    loggers = [
        logging.getLogger(f"lightning.{p}.utilities.rank_zero") for p in ("pytorch", "fabric")
    ]
    for logger in loggers:
        logger.addFilter(tip)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated"
            )
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(tip)


def run_demo(config: DemoConfig) -> list[DemoResult] | None:
    """Train the example VLM once per run in ``config.runs``; the results on rank 0, else None.

    Writes ``demo.json`` (every run's figures) to ``config.output_dir``.
    """
    peak = shared_peak(config.accelerator, config.precision)
    with _quiet_third_party():
        results = [_train(config, run, peak) for run in config.runs]
    if any(r is None for r in results):
        return None
    done = [r for r in results if r is not None]
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "demo.json").write_text(json.dumps([asdict(r) for r in done], indent=2))
    return done
