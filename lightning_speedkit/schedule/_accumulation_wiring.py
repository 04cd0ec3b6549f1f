"""How AccumulationScheduler's accumulation reaches Lightning or DeepSpeed, and what it refuses.

Lightning: ``trainer.accumulate_grad_batches`` is the loss divisor (where windows start
and end is taken over by ``_compat.take_over_accumulation``); the last window of an
epoch, when shorter, gets its gradients scaled back to the mean of the micro-batches
it had. DeepSpeed: the engine's ``set_train_batch_size`` and accumulation boundary are
set, and the engine divides the loss itself; a short last window gets the engine's
batch size for its length, so its step is the same mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from torch.nn.parallel import DistributedDataParallel

from lightning_speedkit import _combined, _compat
from lightning_speedkit.errors import SpeedkitConfigError
from lightning_speedkit.schedule._accumulation_windows import AccumulationWindows


def refuse_other_accumulation(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """Refuse a fit where something else sets the accumulation, or nothing can."""
    if not pl_module.automatic_optimization:
        raise SpeedkitConfigError(
            "AccumulationScheduler drives Lightning's automatic optimization; this "
            "LightningModule sets `automatic_optimization = False`. With manual "
            "optimization, accumulate in `training_step` yourself, or remove the callback."
        )
    if trainer.accumulate_grad_batches != 1:
        raise SpeedkitConfigError(
            f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` and "
            f"AccumulationScheduler both set the accumulation. Remove "
            f"`accumulate_grad_batches` from the Trainer (give the callback "
            f"`target_global_batch=...`) or remove the callback."
        )
    callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    for other in callbacks:
        if isinstance(other, GradientAccumulationScheduler):
            raise SpeedkitConfigError(
                "Lightning's GradientAccumulationScheduler and AccumulationScheduler both "
                "set the accumulation. Keep one: `AccumulationScheduler(schedule={...}, "
                "schedule_unit='epoch')` does what the other does."
            )


def micro_batch(loaders: _combined.TrainLoaders) -> int | None:
    """Samples one step of the train loaders holds on one rank, if the loaders say: a
    step of a dict or list of loaders holds a batch of each."""
    sizes = [_combined.loader_batch_size(loader) for loader in loaders.flat()]
    if not sizes or any(size is None for size in sizes):
        return None
    if not loaders.combined:  # one loader, or one loader's batch a step ("sequential")
        return sizes[0] if len(set(sizes)) == 1 else None
    return sum(size or 0 for size in sizes)


def counted_micro(given: int | None, loader_micro: int | None) -> int | None:
    """The micro-batch to count as training starts: the loader's, said when it is not the
    ``micro_batch_size`` given (or set by MicroBatchTuner, which rebuilt the loader)."""
    if given is None or loader_micro in (None, given):
        return given or loader_micro
    rank_zero_warn(
        f"AccumulationScheduler(micro_batch_size={given}), but the train loader gives "
        f"micro-batches of {loader_micro} samples: counting {loader_micro}, so the global "
        f"batch is what the callback says. `trainer.estimated_stepping_batches`, if read in "
        f"`configure_optimizers`, was counted with {given}; pass "
        f"`micro_batch_size={loader_micro}` (or leave it out)."
    )
    return loader_micro


def refuse_shrinking_batches(loaders: _combined.TrainLoaders) -> None:
    """Refuse a CombinedLoader whose steps lose a loader's batch when it runs out."""
    if loaders.mode != "max_size" or len(loaders.flat()) < 2:
        return
    raise SpeedkitConfigError(
        "AccumulationScheduler got train loaders combined with `mode='max_size'`: once a "
        "shorter loader runs out it gives None, so later micro-batches hold fewer samples "
        "and the global batch would shrink with them. Combine them with "
        '`CombinedLoader(loaders, mode="max_size_cycle")` (what `fit` does with a dict or '
        'list of loaders: a shorter loader starts over) or `mode="min_size"` (the epoch ends '
        "with the shortest), or train without AccumulationScheduler."
    )


def given_micro_batch(trainer: L.Trainer, known: int | None) -> int | None:
    """The micro-batch before ``configure_optimizers``: ``known``, else the one the train
    loaders passed to ``fit`` say, if they do. Those loaders are checked (no shrinking
    batches) either way; a loader from a hook is not built: that would run the user's
    hook early."""
    given = _combined.given(_compat.train_loader_source(trainer).instance)
    refuse_shrinking_batches(given)
    return known or micro_batch(given)


def train_loaders(trainer: L.Trainer) -> tuple[_combined.TrainLoaders | None, int | None]:
    """The fit's train loaders (checked: no shrinking batches) and the micro-batch they
    say, as the fit starts."""
    loaders = _combined.of_trainer(trainer)
    if loaders is None:
        return None, None
    refuse_shrinking_batches(loaders)
    return loaders, micro_batch(loaders)


def batch_micro(batch: Any, loaders: _combined.TrainLoaders | None) -> int:
    """The micro-batch a batch holds, when the loaders do not say: a step of a dict or
    list of loaders holds a batch of each."""
    parts = loaders.parts(batch) if loaders is not None else [batch]
    return sum(int(extract_batch_size(part)) for part in parts)


def deepspeed_engine(trainer: L.Trainer) -> Any:
    """The DeepSpeed engine the fit runs under, or None (not DeepSpeed)."""
    if isinstance(trainer.strategy, DeepSpeedStrategy):
        return trainer.strategy.deepspeed_engine
    return None


def set_accumulation(trainer: L.Trainer, engine: Any, accumulation: int) -> None:
    """Hand ``accumulation`` to Lightning (its loss divisor) or to the DeepSpeed ``engine``."""
    if engine is not None:
        # DeepSpeed divides the loss by its own accumulation: Lightning must not too.
        trainer.accumulate_grad_batches = 1
        engine.set_train_batch_size(
            engine.train_micro_batch_size_per_gpu() * engine.dp_world_size * accumulation
        )
    else:
        trainer.accumulate_grad_batches = accumulation  # Lightning's loss divisor


def take_over_windows(
    trainer: L.Trainer, windows: AccumulationWindows, scheduler: L.Callback
) -> Callable[[], None]:
    """``windows`` place Lightning's accumulation windows while ``scheduler`` is among the
    Trainer's callbacks (a tuner's sweep runs the fit loop with its own only: the
    scheduler's hooks, which count the windows, do not run there). Returns the undo."""

    def active() -> bool:  # the list itself is replaced by the tuner, and put back
        callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
        return scheduler in callbacks

    return _compat.take_over_accumulation(trainer, windows.done, windows.starts, active)


def window_opened(engine: Any, windows: AccumulationWindows) -> None:
    """A window opened: DeepSpeed's ``engine`` (if any) takes its length; a window a
    resumed fit continues is said."""
    set_engine_window(engine, windows.length - windows.lost)
    if windows.lost:
        say_resumed_mid_window(windows)


def engine_window_runs_on(trainer: L.Trainer, engine: Any) -> bool:
    """Whether the DeepSpeed ``engine``'s window runs across an epoch's end: where the
    epoch's length is not known, no short last window can be made for it."""
    return engine is not None and not math.isfinite(trainer.num_training_batches)


def set_engine_window(engine: Any, length: int) -> None:
    """The DeepSpeed ``engine``'s window (if any) is ``length`` micro-batches: where it
    steps, and the divisor of each loss (the engine divides by its accumulation steps):
    an epoch's short last window is then the mean of its micro-batches, as under DDP."""
    if engine is not None and engine.gradient_accumulation_steps() != length:
        engine.set_train_batch_size(
            engine.train_micro_batch_size_per_gpu() * engine.dp_world_size * length
        )


def say_resumed_mid_window(windows: AccumulationWindows) -> None:
    """A fit resumed from a checkpoint taken mid-window (``val_check_interval`` or a
    checkpoint every n batches that the accumulation does not divide)."""
    rank_zero_warn(
        f"AccumulationScheduler: resumed mid-window: {windows.lost} of the {windows.length} "
        f"micro-batches of step {windows.step} ran before the checkpoint, which does not "
        f"hold their gradients. The step is the mean over the "
        f"{windows.length - windows.lost} after it, "
        f"and the windows keep their places (the run's steps, LR schedule and "
        f"`max_steps` as the uninterrupted run's). Checkpoint at optimizer steps "
        f"(`ModelCheckpoint(every_n_train_steps=...)`) to resume exactly."
    )


def rescale_short_window(optimizer: torch.optim.Optimizer, accumulation: int, count: int) -> None:
    """The window ran short (``count`` of ``accumulation`` micro-batches: an epoch's last,
    or one a fit resumed mid-way, whose earlier gradients the checkpoint did not hold):
    Lightning divided each loss by the full accumulation. Make the step the mean over
    the micro-batches it really had."""
    if not 0 < count < accumulation:
        return
    scale = accumulation / count
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.mul_(scale)


def adaptive_applies(trainer: L.Trainer) -> bool:
    """Whether adaptive mode can save communication in this fit (DDP on several ranks);
    when not, says why and that it holds its starting accumulation."""
    if trainer.world_size == 1:
        rank_zero_info(
            "AccumulationScheduler: one process has no gradient communication to amortise; "
            "adaptive mode holds its starting accumulation."
        )
        return False
    if not isinstance(trainer.strategy.model, DistributedDataParallel):
        rank_zero_warn(
            f"AccumulationScheduler: adaptive mode needs DDP's `no_sync` to tell compute from "
            f"communication; {type(trainer.strategy).__name__} reduces gradients on every "
            f"micro-batch, so accumulating would not save communication. It holds its "
            f"starting accumulation."
        )
        return False
    return True


def from_rank_zero(trainer: L.Trainer) -> Callable[[Any], Any]:
    """Hands rank 0's object to every rank: a collective, which every rank must reach."""
    return lambda obj: trainer.strategy.broadcast(obj, src=0)
