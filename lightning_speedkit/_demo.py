"""``speedkit demo``: train the example VLM and report how fast it went and what it learned."""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_speedkit._demo_kit import TowerShare, cache_note, frozen_notes

# Re-exported (``X as X``): the CLI, the tests and benchmarks/hand_tuned.py import them from here.
from lightning_speedkit._demo_kit import _Kit as _Kit
from lightning_speedkit._demo_kit import _KitVLMData as _KitVLMData
from lightning_speedkit._demo_results import DemoConfig as DemoConfig
from lightning_speedkit._demo_results import DemoResult as DemoResult
from lightning_speedkit._demo_results import comparison_table as comparison_table
from lightning_speedkit._demo_results import time_per_sample as time_per_sample
from lightning_speedkit.distributed import DDPPowerSGDStrategy
from lightning_speedkit.measure import SpeedMonitor
from lightning_speedkit.measure.peak import measure_matmul_peak
from lightning_speedkit.measure.speed_monitor import PeakSetting
from lightning_speedkit.schedule import accumulation_for
from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule, VLMTask

POWERSGD_RANK = 4
"""The kit's PowerSGD rank with several devices: on two CPU processes rank 1 (the
strategy's default) left the tiny VLM, trained with AdamW, on its caption-only plateau
in every seed tried, rank 2 part of the way; rank 4 ends where plain DDP does
(``benchmarks/powersgd_rank.py``)."""


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


def _train(config: DemoConfig, run: str, peak: PeakSetting) -> DemoResult | None:
    """One run of the example VLM; ``run`` is "plain" (Lightning as it is) or "kit"."""
    L.seed_everything(config.seed, workers=True, verbose=False)
    tokenizer = CaptionTokenizer()
    model_cfg = VLMConfig.preset(
        config.size,  # type: ignore[arg-type]
        tokenizer.vocab_size,
        freeze_vision=config.freeze_vision,
    )
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
    tower = TowerShare(config.warmup_steps) if config.freeze_vision and run == "plain" else None
    callbacks: list[L.Callback] = [tower] if tower is not None else []
    if kit is not None:
        callbacks = [*kit.callbacks(), kit.cache_at_start]
    fitted = fit_and_measure(
        config,
        run,
        task,
        datamodule,
        peak,
        callbacks=callbacks,
        strategy=strategy,
        accumulate_grad_batches=accumulation if run == "plain" else 1,
    )
    if fitted is None:
        return None
    result, trainer = fitted
    notes = kit.notes(config) if kit is not None else []
    if config.freeze_vision:
        notes += frozen_notes(kit.frozen if kit is not None else None, tower)
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
    names = ("lightning.pytorch", "lightning.fabric", "pytorch_lightning")  # the last: where
    loggers = [  # Lightning logs once `pytorch_lightning` is imported
        logging.getLogger(f"{package}.utilities.rank_zero") for package in names
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
