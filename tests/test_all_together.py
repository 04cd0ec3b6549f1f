"""Every public callback at once on the example VLM, and a resume with all of them.

The run is cut at an epoch end (Lightning resumes a plain loader cleanly there) and
resumed with fresh callbacks from the checkpoint: the losses after the cut must be the
uninterrupted run's, and each callback must go on from its saved state, not start over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader

import lightning_speedkit
from lightning_speedkit import (
    AccumulationScheduler,
    ActivationCheckpointing,
    AttentionSwap,
    NumWorkersTuner,
    ProfilerSchedule,
    SpeedMonitor,
)
from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule, VLMTask

from .conftest import SMALL_CORPUS

MICRO, EPOCH_BATCHES, ACCUMULATION = 8, 4, 2  # two optimizer steps per epoch


class InOrder(VLMDataModule):
    """The example's data without shuffling, so a resumed epoch sees the same batches."""

    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader("train", shuffle=False)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}  # by (epoch, batch) position in the run

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any,
                           batch: Any, batch_idx: int) -> None:  # fmt: skip
        index = trainer.current_epoch * EPOCH_BATCHES + batch_idx
        self.losses[index] = float(outputs["loss"].detach())
        self.accumulation = trainer.accumulate_grad_batches  # AccumulationScheduler's, in flight


def callbacks(tmp_path: Path) -> list[L.Callback]:
    return [
        SpeedMonitor(warmup_steps=1, log_every_n_steps=2),
        NumWorkersTuner(progress=False, batches=4, warmup_batches=1, cache=False),
        AttentionSwap(backend="sdpa", verbose=False),
        AccumulationScheduler(
            target_global_batch=MICRO * ACCUMULATION, micro_batch_size=MICRO, verbose=False
        ),
        ActivationCheckpointing(verbose=False),
        ProfilerSchedule(
            skip_first=1,
            wait=0,
            warmup=1,
            active=1,
            repeat=1,
            dirpath=tmp_path / "profiler",
            with_stack=False,
        ),
        ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1),
        Losses(),
    ]


def fit(small_corpus: Path, tmp_path: Path, steps: int, ckpt: Path | None = None) -> L.Trainer:
    torch.manual_seed(0)
    tokenizer = CaptionTokenizer()
    config = VLMConfig.preset("tiny", tokenizer.vocab_size)
    data = InOrder.for_model(config, str(small_corpus), batch_size=MICRO,
                             corpus=SMALL_CORPUS, progress=False)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, limit_train_batches=EPOCH_BATCHES,
        limit_val_batches=0, logger=False, callbacks=callbacks(tmp_path),
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(VLMTask(config, pad_id=tokenizer.pad_id), datamodule=data, ckpt_path=ckpt)
    return trainer


def _callback(trainer: L.Trainer, kind: type[L.Callback]) -> Any:
    return next(c for c in trainer.callbacks if isinstance(c, kind))  # type: ignore[attr-defined]


def test_every_callback_together_trains_and_resumes_exactly(
    small_corpus: Path, tmp_path: Path
) -> None:
    straight = fit(small_corpus, tmp_path / "straight", steps=4)
    assert straight.global_step == 4
    losses = _callback(straight, Losses).losses
    assert len(losses) == 2 * EPOCH_BATCHES  # 4 optimizer steps of 2 micro-batches
    monitor = _callback(straight, SpeedMonitor)
    assert monitor.summary["samples_per_sec"] > 0
    swap = _callback(straight, AttentionSwap)
    assert swap.report is not None
    assert len(swap.report.swapped) == 4  # 2 vision + 2 text blocks
    assert _callback(straight, ActivationCheckpointing).checkpointed
    assert _callback(straight, Losses).accumulation == ACCUMULATION
    profiler = _callback(straight, ProfilerSchedule)
    assert len(profiler.traces) == 1
    assert profiler.report is not None

    first = fit(small_corpus, tmp_path / "cut", steps=2)  # one epoch, checkpoint at its end
    (ckpt,) = sorted((tmp_path / "cut" / "ckpt").glob("*.ckpt"))
    resumed = fit(small_corpus, tmp_path / "resumed", steps=4, ckpt=ckpt)
    assert resumed.global_step == 4
    before = _callback(first, Losses).losses
    after = _callback(resumed, Losses).losses
    assert sorted(before) == list(range(EPOCH_BATCHES))
    assert sorted(after) == list(range(EPOCH_BATCHES, 2 * EPOCH_BATCHES))
    for index, loss in {**before, **after}.items():
        assert loss == pytest.approx(losses[index], rel=1e-5), index
    # each callback went on from its state
    assert _callback(resumed, Losses).accumulation == ACCUMULATION
    assert _callback(resumed, ProfilerSchedule).traces == []  # its one window was taken
    assert len(_callback(first, ProfilerSchedule).traces) == 1


def test_every_registered_strategy_name_resolves() -> None:
    names = {
        "ddp_powersgd": lightning_speedkit.DDPPowerSGDStrategy,
        "ddp_fp16_compress": lightning_speedkit.DDPHalfPrecisionStrategy,
        "ddp_bf16_compress": lightning_speedkit.DDPHalfPrecisionStrategy,
        "fsdp_zero2": lightning_speedkit.FSDPZeRO2Strategy,
        "fsdp2_zero2": lightning_speedkit.FSDP2ZeRO2Strategy,
        "deepspeed_zero2": lightning_speedkit.DeepSpeedZeRO2Strategy,
        "deepspeed_zero2_offload": lightning_speedkit.DeepSpeedZeRO2Strategy,
    }
    for name, cls in names.items():
        assert name in StrategyRegistry, name
        if cls is lightning_speedkit.DeepSpeedZeRO2Strategy and not _deepspeed():
            continue
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, cls), name
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=name, logger=False)
        assert isinstance(trainer.strategy, cls), name


def _deepspeed() -> bool:
    from lightning_speedkit import _imports

    return bool(_imports.DEEPSPEED_AVAILABLE)
