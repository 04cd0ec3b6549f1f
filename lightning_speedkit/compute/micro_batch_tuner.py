"""MicroBatchTuner: the fastest micro-batch that fits, at an unchanged global batch.

The callback decides when: it checks the fit in ``setup``, tunes in ``on_fit_start``
with :func:`~lightning_speedkit.compute.tune_micro_batch` (the search, in
``micro_batch_search.py``), trains with the choice, and keeps it in checkpoints. The
loader's rescale lives in ``_loader_rescale.py``, the checks in ``_fit_requirements.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lightning_speedkit import _compat, _validation
from lightning_speedkit._loggers import log_metrics
from lightning_speedkit.compute._fit_requirements import global_batch_scheduler, loader_to_tune
from lightning_speedkit.compute._loader_rescale import (
    BATCH_COUNTS,
    batches_in,
    rescaled_counts,
    resized,
)
from lightning_speedkit.compute._memory_probe import memory_limit, optimizer_state_bytes
from lightning_speedkit.compute._step_batch import as_the_step_gets_it
from lightning_speedkit.compute._step_timer import Measure, StepMeasurement, timed_measure
from lightning_speedkit.compute._trial_state import no_logging
from lightning_speedkit.compute.micro_batch_search import (
    MicroBatchResult,
    _check_micro_batch_arguments,
    table_text,
    tune_micro_batch,
)
from lightning_speedkit.data.worker_search import rebuild_dataloader
from lightning_speedkit.schedule.accumulation_scheduler import AccumulationScheduler

__all__ = [
    "MicroBatchResult",
    "MicroBatchTuner",
    "StepMeasurement",
    "memory_limit",
    "timed_measure",
    "tune_micro_batch",
]


def _trial_step(strategy: Any, pl_module: L.LightningModule) -> Any:
    """The training step as the trials run it: ``self.log`` off, in the Trainer's precision;
    through the strategy's wrapper where its forward gathers shards (all ranks run it)."""
    wrapper = strategy.model
    direct = wrapper is None or wrapper is pl_module or isinstance(wrapper, DistributedDataParallel)

    def step(batch: Any) -> Any:
        with no_logging(pl_module):
            if not direct:  # the wrapper's forward gathers shards: all ranks run it
                return strategy.training_step(batch, 0)
            with strategy.precision_plugin.train_step_context():
                return pl_module.training_step(batch, 0)

    return step


def _cut(best: int, target: int, world_size: int) -> str:
    """``micro-batch 8 x 4 accumulation x 2 rank(s) = global batch 64``, and where it misses."""
    accumulation = max(1, target // (best * world_size))
    trained = best * accumulation * world_size
    return (
        f"micro-batch {best} x {accumulation} accumulation x {world_size} rank(s) = "
        f"global batch {trained}"
        + ("" if trained == target else f", not the target {target}: {best} does not divide it")
    )


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
        repeats: the fewest timed runs per candidate (a short step runs until 20 ms of
            runs are timed); the median counts.
        confirm_rounds: re-timings of the fastest size and the runner-up, in turns
            (A B A B A B), after the search; the faster by those medians wins. 0 keeps
            the first measurements; raise it on a machine others share.
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
        confirm_rounds: int = 3,
        measure: Measure | None = None,
        verbose: bool = True,
    ) -> None:
        self.candidates = _check_micro_batch_arguments(candidates, max_micro_batch, memory_headroom)
        _check_timing_arguments(warmup, repeats, confirm_rounds, measure, verbose)
        self.max_micro_batch = max_micro_batch
        self.memory_headroom = float(memory_headroom)
        self.warmup = warmup
        self.repeats = repeats
        self.confirm_rounds = confirm_rounds
        self.measure = measure
        self.verbose = verbose
        self.result: MicroBatchResult | None = None
        self._scheduler: AccumulationScheduler | None = None
        self._chosen: int | None = None
        self._loaded: dict[str, Any] = {}
        self._pending: tuple[L.Trainer, DataLoader[Any]] | None = None
        self._counts: dict[str, Any] | None = None  # the Trainer's, before the new micro-batch

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._scheduler, self._chosen, self._pending = None, None, None
        self._restore_counts(trainer)  # a fit that raised
        _compat.drop_train_loader_change(trainer, "MicroBatchTuner")  # a fit that raised
        self._scheduler = global_batch_scheduler(trainer, pl_module)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        scheduler = self._scheduler
        loader = None if scheduler is None else loader_to_tune(trainer)
        if scheduler is None or loader is None:
            return
        global_batch = int(scheduler.target_global_batch or 0)
        saved = _saved_choice(self._loaded, global_batch, trainer.world_size)
        self._loaded = {}
        if saved is not None:
            self._keep(trainer, loader, saved, global_batch)
            return
        result = _tune_in_fit(self, trainer, pl_module, loader, global_batch)
        best = int(trainer.strategy.broadcast(result.best["batch_size"], src=0))
        self.result = _chosen_by_rank_zero(result, best, trainer.world_size)
        self._apply(trainer, loader, best, "")
        self._pending = (trainer, loader)

    def _apply(self, trainer: L.Trainer, loader: DataLoader[Any], best: int, how: str) -> None:
        assert self._scheduler is not None  # set in setup
        self._chosen = best
        first = loader if best == loader.batch_size else rebuild_dataloader(loader, batch_size=best)
        self._count_in_new_batches(trainer, int(loader.batch_size or best), best, batches_in(first))
        # Loaders the fit loop requests later (`reload_dataloaders_every_n_epochs`) come
        # from the user's hook at its own batch size: each is resized too.
        _compat.change_train_loader(
            trainer, "MicroBatchTuner", partial(resized, best=best), first, before_loop=True
        )
        self._scheduler.set_micro_batch_size(best)
        if not self.verbose:
            return
        cut = _cut(best, self._scheduler.target_global_batch or best, trainer.world_size)
        if how:
            rank_zero_info(f"MicroBatchTuner: {cut}, {how}.")
            return
        assert self.result is not None
        rank_zero_info(
            f"MicroBatchTuner: {cut} (was micro-batch {loader.batch_size}; tuned in "
            f"{self.result.seconds:.1f} s):\n{table_text(self.result)}"
        )

    def _count_in_new_batches(
        self, trainer: L.Trainer, given: int, best: int, batches: int | None
    ) -> None:
        """Keep what the Trainer's batch counts mean in samples (see :func:`rescaled_counts`),
        from the counts as the user gave them, at most the new epoch's ``batches``."""
        if self._counts is None:
            self._counts = {name: getattr(trainer, name) for name in BATCH_COUNTS}
        overfit = bool(getattr(trainer, "overfit_batches", None))
        for name, (value, said) in rescaled_counts(
            self._counts, given, best, batches, overfit=overfit
        ).items():
            setattr(trainer, name, value)
            if said is not None and self.verbose:
                rank_zero_info(said)

    def _restore_counts(self, trainer: L.Trainer) -> None:
        for name, value in (self._counts or {}).items():
            setattr(trainer, name, value)
        self._counts = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pending = None
        if self._chosen is None or self._scheduler is None:
            return
        global_batch = self._scheduler.target_global_batch or self._chosen
        rate = self.result.best_samples_per_sec if self.result is not None else None
        metrics = _metrics(self._chosen, global_batch, trainer.world_size, rate)
        log_metrics(trainer, metrics)

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
        saved = _saved_choice(self._loaded, global_batch, trainer.world_size)
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


def _check_timing_arguments(
    warmup: int, repeats: int, confirm_rounds: int, measure: Measure | None, verbose: bool
) -> None:
    _validation.non_negative_int("warmup", warmup, example=1)
    _validation.positive_int("repeats", repeats, example=3)
    _validation.non_negative_int("confirm_rounds", confirm_rounds, example=3,
                                 hint="or 0 to keep the first measurements")  # fmt: skip
    fix = "pass `lambda run, micro_batch: StepMeasurement(...)`, or None"
    _validation.optional(_validation.function, "measure", measure, fix=fix)
    _validation.boolean("verbose", verbose)


def _tune_in_fit(
    tuner: MicroBatchTuner,
    trainer: L.Trainer,
    pl_module: L.LightningModule,
    loader: DataLoader[Any],
    global_batch: int,
) -> MicroBatchResult:
    """:func:`tune_micro_batch` with ``tuner``'s settings on the fit's model, step, device
    and ranks.

    Every rank runs the same sizes and stops where any rank stops: a rank's own search
    could end elsewhere (another device's memory), and a training step that
    communicates (a contrastive loss's all_gather) would then hang.
    """
    strategy = trainer.strategy
    lockstep = trainer.world_size > 1
    result = tune_micro_batch(
        strategy.model if strategy.model is not None else pl_module,
        loader,
        _trial_step(strategy, pl_module),
        candidates=tuner.candidates,
        max_micro_batch=tuner.max_micro_batch,
        memory_headroom=tuner.memory_headroom,
        global_batch=global_batch,
        world_size=trainer.world_size,
        to_device=partial(as_the_step_gets_it, trainer),  # the fit loop's way to the step
        reserve_bytes=optimizer_state_bytes(trainer.optimizers),
        measure=tuner.measure or timed_measure(strategy.root_device, tuner.warmup, tuner.repeats),
        confirm_rounds=tuner.confirm_rounds,
        agree=(lambda ok: bool(strategy.reduce_boolean_decision(ok, all=True)))
        if lockstep
        else None,
    )
    _warn_batch_norm(pl_module, loader.batch_size, result.best["batch_size"])
    return result


def _warn_batch_norm(model: L.LightningModule, given: int | None, best: int) -> None:
    """Say that a micro-batch other than the loader's changes what the model's batch norm
    layers in training normalise by: each micro-batch's statistics (the global batch and
    the gradient's average stay, those numerics do not)."""
    norms = [name for name, m in model.named_modules() if _trains_batch_norm(m)]
    if best == given or not norms:
        return
    shown = ", ".join(f"`{n}`" for n in norms[:3]) + (", ..." if len(norms) > 3 else "")
    rank_zero_warn(
        f"MicroBatchTuner trains micro-batches of {best} (the loader gives {given}): the "
        f"batch norm layers {shown} normalise by each micro-batch's statistics, so training "
        f"changes with it beyond speed. Keep the loader's size with "
        f"`MicroBatchTuner(candidates=[{given}])`, or leave the tuner out."
    )


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _trains_batch_norm(module: nn.Module) -> bool:
    return isinstance(module, _BATCH_NORMS) and module.training


def _chosen_by_rank_zero(result: MicroBatchResult, best: int, world_size: int) -> MicroBatchResult:
    """This rank's ``result`` with rank 0's choice ``best`` (its own rate for that size)."""
    if best == result.best["batch_size"]:
        return result
    rates = [r["samples_per_sec"] for r in result.table if r["micro_batch"] == best]
    return replace(
        result, best={"batch_size": best}, best_samples_per_sec=rates[0] if rates else None,
        accumulation=int(result.global_batch or 0) // (best * world_size),
    )  # fmt: skip


def _saved_choice(loaded: dict[str, Any], global_batch: int, world_size: int) -> int | None:
    """A checkpoint's micro-batch, where it was saved for this global batch and still
    divides each rank's share of it (the world size may have changed); else None."""
    saved = loaded.get("batch_size")
    if not isinstance(saved, int) or loaded.get("global_batch") != global_batch:
        return None
    if (global_batch // world_size) % saved:
        rank_zero_info(
            f"MicroBatchTuner: the checkpoint's micro-batch {saved} does not divide the global "
            f"batch {global_batch} over {world_size} ranks; tuning again."
        )
        return None
    return saved


def _metrics(
    chosen: int, global_batch: int, world_size: int, rate: float | None
) -> dict[str, float]:
    """What is logged when training starts: the micro-batch, its accumulation, its rate."""
    metrics = {
        "micro_batch/size": float(chosen),
        "micro_batch/accumulation": float(global_batch // (chosen * world_size)),
    }
    if rate:
        metrics["micro_batch/samples_per_sec"] = rate
    return metrics
