"""``speedkit demo``: train the example VLM and report how fast it went and what it learned."""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule, VLMTask


@dataclass(frozen=True)
class DemoConfig:
    """What ``speedkit demo`` trains; each field is a command-line flag."""

    steps: int = 4000
    size: str = "tiny"
    accelerator: str = "auto"
    devices: int = 1
    precision: str = "32-true"
    batch_size: int = 32
    num_workers: int = 0
    data_dir: str | None = None
    output_dir: str = "speedkit_runs/demo"
    seed: int = 0
    warmup_steps: int = 10
    """Steps left out of the speed figures (start-up, allocator warm-up)."""


@dataclass
class DemoResult:
    """One training run's figures. Speeds cover the steps after ``warmup_steps``."""

    size: str
    params: int
    devices: int
    steps: int
    samples_per_sec: float
    step_ms_p50: float
    step_ms_p90: float
    loss_start: float
    loss_end: float
    val_loss: float
    val_acc: float
    wall_sec: float
    extra: dict[str, Any] = field(default_factory=dict)

    def table(self) -> str:
        rows = [
            ("model", f"{self.size} ({self.params / 1e6:.2f} M parameters)"),
            ("devices", str(self.devices)),
            ("steps", str(self.steps)),
            ("samples/s", f"{self.samples_per_sec:,.1f}"),
            ("step time p50 (ms)", f"{self.step_ms_p50:.1f}"),
            ("step time p90 (ms)", f"{self.step_ms_p90:.1f}"),
            ("train loss, first steps", f"{self.loss_start:.3f}"),
            ("train loss, last steps", f"{self.loss_end:.3f}"),
            ("held-out loss", f"{self.val_loss:.3f}"),
            ("held-out token accuracy", f"{self.val_acc:.1%}"),
            ("wall time (s)", f"{self.wall_sec:.1f}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


class _StepClock(L.Callback):
    """Host timestamps and losses of every training step, read once at the end.

    Losses stay device tensors until the run ends, so no step waits on the device.
    Timestamps are host clocks: on an accelerator they measure when the host got
    through each step, which over many steps matches the device's pace.
    """

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.stamps.append(time.perf_counter())
        if isinstance(outputs, dict) and "loss" in outputs:
            self.losses.append(outputs["loss"].detach())


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]


def run_demo(config: DemoConfig) -> DemoResult | None:
    """Train the example VLM as ``config`` says; return the figures on rank 0, else None."""
    L.seed_everything(config.seed, workers=True, verbose=False)
    tokenizer = CaptionTokenizer()
    model_cfg = VLMConfig.preset(config.size, tokenizer.vocab_size)  # type: ignore[arg-type]
    datamodule = VLMDataModule(
        data_dir=config.data_dir,
        image_size=model_cfg.image_size,
        max_text_len=model_cfg.max_text_len,
        batch_size=config.batch_size,
        num_workers=config.num_workers,
    )
    task = VLMTask(model_cfg, pad_id=tokenizer.pad_id)
    clock = _StepClock()
    output_dir = Path(config.output_dir)
    trainer = L.Trainer(
        accelerator=config.accelerator,
        devices=config.devices,
        precision=config.precision,  # type: ignore[arg-type]
        max_steps=config.steps,
        limit_val_batches=0,  # one held-out pass after training, below
        logger=CSVLogger(output_dir, name="logs"),
        callbacks=[clock],
        enable_checkpointing=False,
        log_every_n_steps=50,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(task, datamodule=datamodule)
    wall = time.perf_counter() - start
    trainer.limit_val_batches = 1.0
    (metrics,) = trainer.validate(task, datamodule=datamodule, verbose=False)
    if trainer.global_rank != 0:
        return None

    gaps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False)][
        config.warmup_steps :
    ]
    if not gaps:
        gaps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False)] or [wall]
    losses = torch.stack(clock.losses).float().cpu().tolist()  # one read at the end of the run
    head = max(1, min(10, len(losses) // 10))
    tail = max(1, len(losses) // 10)
    global_batch = config.batch_size * trainer.world_size
    result = DemoResult(
        size=config.size,
        params=sum(p.numel() for p in task.model.parameters()),
        devices=trainer.world_size,
        steps=trainer.global_step,
        samples_per_sec=global_batch / statistics.fmean(gaps),
        step_ms_p50=1e3 * _percentile(gaps, 50),
        step_ms_p90=1e3 * _percentile(gaps, 90),
        loss_start=statistics.fmean(losses[:head]),
        loss_end=statistics.fmean(losses[-tail:]),
        val_loss=float(metrics["val/loss"]),
        val_acc=float(metrics["val/acc"]),
        wall_sec=wall,
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "demo.json").write_text(json.dumps(asdict(result), indent=2))
    return result
