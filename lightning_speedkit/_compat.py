"""Every place the kit reads something Lightning does not type publicly, in one module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L


def log_every_n_steps(trainer: L.Trainer) -> int:
    """The Trainer's ``log_every_n_steps`` (set at runtime by its logger connector)."""
    value = getattr(trainer, "log_every_n_steps", 50)
    return int(value)


def train_loader_source(trainer: L.Trainer) -> Any:
    """Where the fit loop will request its train loader (Lightning's ``_DataLoaderSource``).

    It has ``dataloader()`` (calls the DataModule's or LightningModule's hook, or returns
    the loader passed to ``fit``), and ``instance``/``name``, which decide what is called.
    """
    return trainer.fit_loop._data_source


def replace_train_loader(trainer: L.Trainer, loader: Any) -> None:
    """Make the fit loop use ``loader`` as if it had been passed to ``fit``."""
    source = trainer.fit_loop._data_source
    source.instance = loader
    source.name = "train_dataloader"


def reload_train_loader_next_epoch(trainer: L.Trainer) -> Callable[[], None]:
    """Make the fit loop request its train loader again when the next epoch starts.

    Through Lightning's own switch, the Trainer's ``reload_dataloaders_every_n_epochs``
    (which its stubs do not declare), set to 1 until the returned function puts the
    user's value back: call that once the next epoch has started
    (``on_train_epoch_start``, after the loop has reloaded). Call this after the
    epoch's validation (``on_train_epoch_end``), or the validation loaders reload too.
    """
    before = getattr(trainer, "reload_dataloaders_every_n_epochs", 0)
    trainer.reload_dataloaders_every_n_epochs = 1  # type: ignore[attr-defined]

    def restore() -> None:
        trainer.reload_dataloaders_every_n_epochs = before  # type: ignore[attr-defined]

    return restore


def datamodule(trainer: L.Trainer) -> Any:
    """The Trainer's DataModule or None (a property Lightning's stubs do not declare)."""
    return getattr(trainer, "datamodule", None)


def add_callback_once(trainer: L.Trainer, callback: L.Callback) -> None:
    """Append ``callback`` to the Trainer's callbacks unless one of its type is there.

    Strategies use it from ``setup_environment``, which Lightning runs before it
    restores callback state from a checkpoint.
    """
    callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    if not any(type(c) is type(callback) for c in callbacks):
        callbacks.append(callback)


def take_over_accumulation(
    trainer: L.Trainer,
    window_done: Callable[[], bool],
    window_starts: Callable[[], bool],
) -> Callable[[], None]:
    """Let the caller decide where gradient-accumulation windows start and end.

    Lightning decides both with ``batch_idx % accumulate_grad_batches`` counted from the
    start of each epoch, so a factor changed mid-epoch puts a window's edges in the wrong
    places (stale gradients carried into the next step). Two methods decide:

    - ``_TrainingEpochLoop._accumulated_batches_reached()``: "does this batch close a
      window" (everything else -- ``_should_accumulate``, DDP's ``no_sync``, checkpoint
      and logger step counting -- derives from it);
    - ``_AutomaticOptimization._make_zero_grad_fn(batch_idx, optimizer)``: "does this
      batch open one" (zero the gradients first).

    Both are replaced on the loop instances; ``accumulate_grad_batches`` keeps its other
    job, the loss divisor. Returns the function that puts Lightning's own back.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    automatic = epoch_loop.automatic_optimization
    for owner, name in ((epoch_loop, "_accumulated_batches_reached"),
                        (automatic, "_make_zero_grad_fn")):  # fmt: skip
        if not callable(getattr(owner, name, None)):
            raise RuntimeError(
                f"This Lightning ({L.__version__}) has no `{type(owner).__name__}.{name}`, which "
                f"AccumulationScheduler drives. It is tested with Lightning 2.x up to 2.6; "
                f"please report the version."
            )
    lightning_zero_grad_fn = automatic._make_zero_grad_fn

    def make_zero_grad_fn(batch_idx: int, optimizer: Any) -> Callable[[], None] | None:
        if not window_starts():
            return None
        divisor = trainer.accumulate_grad_batches
        trainer.accumulate_grad_batches = 1  # Lightning's own check then says "zero now"
        try:
            return lightning_zero_grad_fn(batch_idx, optimizer)
        finally:
            trainer.accumulate_grad_batches = divisor

    epoch_loop._accumulated_batches_reached = window_done  # type: ignore[method-assign]
    automatic._make_zero_grad_fn = make_zero_grad_fn  # type: ignore[method-assign]

    def restore() -> None:
        epoch_loop.__dict__.pop("_accumulated_batches_reached", None)
        automatic.__dict__.pop("_make_zero_grad_fn", None)

    return restore


def default_process_group_store() -> Any:
    """The rendezvous store of torch.distributed's default process group; None without one.

    torch keeps it private (``distributed_c10d._get_default_store``); HangWatchdog talks
    to the other ranks through it, outside every collective.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_store is None:
        raise RuntimeError(
            f"This torch ({torch.__version__}) has no "
            f"`torch.distributed.distributed_c10d._get_default_store`, which HangWatchdog "
            f"uses to reach the other ranks. It is tested with torch 2.x up to 2.13; please "
            f"report the version, and remove HangWatchdog from the Trainer meanwhile."
        )
    return get_store()


def torch_profiler_enabled() -> bool:
    """Whether a torch.profiler session is running in this process (torch has one per
    process; a second profiler must not start or stop it)."""
    import torch

    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    if enabled is None:
        raise RuntimeError(
            f"This torch ({torch.__version__}) has no `torch.autograd._profiler_enabled`, which "
            f"ProfilerSchedule reads to stand down beside another profiler. Please report the "
            f"version."
        )
    return bool(enabled())


def has_compiled_parts(model: Any) -> bool:
    """Whether ``model`` holds modules that ``torch.compile`` compiles at their first call:
    compiled in place (``nn.Module.compile``, the kit's RegionalCompile) or wrapped
    (``torch.compile(module)``, an ``OptimizedModule``)."""
    import torch

    optimized = getattr(torch._dynamo.eval_frame, "OptimizedModule", ())
    return any(
        getattr(module, "_compiled_call_impl", None) is not None or isinstance(module, optimized)
        for module in model.modules()
    )
