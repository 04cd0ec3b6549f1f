"""What MicroBatchTuner needs of a fit, checked before anything runs, and the loader it tunes.

It keeps the optimizer's global batch, so it needs an ``AccumulationScheduler`` with a
``target_global_batch`` the ranks share evenly, automatic optimization (the scheduler
sets the accumulation), and a strategy that lets the micro-batch change (not DeepSpeed,
whose engine fixes it). It tunes one torch DataLoader batched by ``batch_size``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lightning_speedkit import _compat
from lightning_speedkit.compute.micro_batch_search import why_unbatched
from lightning_speedkit.errors import SpeedkitConfigError
from lightning_speedkit.schedule.accumulation_scheduler import AccumulationScheduler

__all__ = ["global_batch_scheduler", "loader_to_tune"]


def _refuse_strategy_and_optimization(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """DeepSpeed fixes the micro-batch; manual optimization accumulates by hand."""
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


def global_batch_scheduler(
    trainer: L.Trainer, pl_module: L.LightningModule
) -> AccumulationScheduler:
    """The AccumulationScheduler whose ``target_global_batch`` the tuner keeps; or the refusal
    that says what to change."""
    _refuse_strategy_and_optimization(trainer, pl_module)
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
    return scheduler


def loader_to_tune(trainer: L.Trainer) -> DataLoader[Any] | None:
    """The train loader to tune; None (said why) where this fit trains no batch or the
    loader is not a single DataLoader. A loader without a ``batch_size`` is refused."""
    if (reason := _compat.trains_no_batch(trainer)) is not None:
        rank_zero_info(f"MicroBatchTuner: {reason}.")
        return None
    loader = _compat.train_loader_source(trainer).dataloader()
    if not isinstance(loader, DataLoader):
        rank_zero_warn(
            f"MicroBatchTuner tunes a single torch DataLoader; the train loader is a "
            f"{type(loader).__name__}, so its batch size is left as it is."
        )
        return None
    if loader.batch_size is None:  # with a size, the loader made its batch sampler
        why, fix = why_unbatched(loader)
        raise SpeedkitConfigError(
            f"MicroBatchTuner sets the train loader's `batch_size`, and {why}. To use the "
            f"tuner, {fix}; or remove MicroBatchTuner."
        )
    return loader
