"""AccumulationScheduler: accumulation by global batch, by schedule, or by communication share."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_speedkit import _combined, _validation
from lightning_speedkit._loggers import log_metrics
from lightning_speedkit.errors import SpeedkitConfigError
from lightning_speedkit.measure._clock import Stamps
from lightning_speedkit.schedule import _accumulation_wiring as wiring
from lightning_speedkit.schedule._accumulation_windows import (
    AccumulationChange,
    AccumulationWindows,
)
from lightning_speedkit.schedule._lr_scaling import LR_POWER, LrScaling
from lightning_speedkit.schedule.policies import (
    CommShare,
    ScheduleUnit,
    accumulation_for,
    check_schedule,
    first_global_batch,
)

__all__ = ["AccumulationChange", "AccumulationScheduler", "CommShare", "accumulation_for"]

log = logging.getLogger(__name__)


def _positive_int(value: Any, argument: str) -> int:
    return _validation.positive_int(argument, value, example=64)


class AccumulationScheduler(L.Callback):
    """Gradient accumulation set by a global batch, a schedule, or the measured communication.

    Three modes; the numbers are global batches (samples per optimizer step summed over
    all ranks), so the same setting means the same optimisation on 1 or 64 devices:

    - ``target_global_batch=N``: accumulation = N / (micro-batch x world size), worked
      out again when a resumed run has another world size. A target the micro-batch
      and world size cannot make exactly is rounded, with one warning naming the
      global batch used.
    - ``schedule={step: N, ...}``: a batch-size ramp keyed by optimizer steps (or by
      epochs with ``schedule_unit="epoch"``). Before the first key, one micro-batch per
      step. Unlike Lightning's ``GradientAccumulationScheduler`` the change may fall
      mid-epoch: windows are counted by this callback, not from the epoch start.
    - ``adaptive=True``: measures the share of each step spent in gradient
      communication that backward did not hide (the synchronising micro-batch against
      the ``no_sync`` ones) and raises accumulation while that share is above
      ``comm_threshold``, never past ``max_global_batch``. Combine it with
      ``target_global_batch`` to set the starting point (default: one micro-batch).
      Starting from one micro-batch, it first runs two per step for a few steps, as
      the measurement needs one unsynchronised micro-batch. It never lowers
      accumulation after that first measurement. Needs DDP (any of the kit's DDP
      strategies): FSDP and DeepSpeed ZeRO reduce gradients on every micro-batch,
      so accumulating does not save their communication.

    Each mode is a policy of :mod:`lightning_speedkit.schedule.policies`
    (:class:`~lightning_speedkit.schedule.policies.TargetGlobalBatch`,
    :class:`~lightning_speedkit.schedule.policies.StepSchedule`,
    :class:`~lightning_speedkit.schedule.policies.AdaptiveToCommunication`), built for
    the fit's micro-batch and world size and asked at each window's first micro-batch.
    A Trainer-free core counts the windows and times them for the adaptive policy; this
    callback tells it where each micro-batch falls and wires the answer into Lightning
    (or DeepSpeed).

    Changes take effect only at optimizer-step boundaries. Each step's loss is the mean
    over its micro-batches, as Lightning does (the loss is divided by the accumulation);
    the last window of an epoch, when shorter, is scaled to the mean of the
    micro-batches it had (Lightning divides it by the full accumulation). Under DDP the
    non-final micro-batches run under ``no_sync``; under DeepSpeed the engine's own
    ``set_train_batch_size`` and accumulation boundary are set, and the engine divides
    the loss.

    Args:
        target_global_batch: samples per optimizer step over all ranks.
        schedule: ``{step or epoch: global batch}``.
        schedule_unit: what ``schedule`` keys count, ``"step"`` (optimizer steps, the
            default) or ``"epoch"``.
        adaptive: raise accumulation while communication is above ``comm_threshold``.
        comm_threshold: the exposed-communication share of a step that adaptive mode
            accepts (0 to 1). 0.3 is a good start; lower trades larger batches for speed.
        max_global_batch: adaptive mode's ceiling (required with ``adaptive``). Choose
            it as you would the largest batch your learning rate tolerates.
        micro_batch_size: samples per micro-batch on one rank. By default the train
            loader's ``batch_size`` (or its batch sampler's), else the first batch's.
            Give it when a scheduler sizes itself from ``trainer.estimated_stepping_batches``
            so the accumulation is known before ``configure_optimizers``.
        lr_scaling: scale the learning rate with the global batch, ``"linear"``
            (Goyal et al. 2017; SGD) or ``"sqrt"`` (often better for Adam), by
            ``(global batch / base_global_batch) ** p``. Applied around each
            ``optimizer.step`` and taken off again, so LR schedulers and checkpoints
            keep their own values; logged as ``accumulation/lr_scale``.
        base_global_batch: the global batch your learning rate was tuned for; by
            default the global batch of the run's first step.
        measure_steps: optimizer steps per adaptive measurement (medians over them).
        verbose: print each change (rank 0).

    After fit, ``history`` lists every change (:class:`AccumulationChange`) and
    ``measurements`` every adaptive measurement (:class:`CommShare`; the latest is
    ``comm_share``). Both are in checkpoints; a resumed run continues where it was.

    Example::

        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[AccumulationScheduler(target_global_batch=256)],
        ...                     logger=False)
    """

    def __init__(
        self,
        target_global_batch: int | None = None,
        schedule: Mapping[int, int] | None = None,
        adaptive: bool = False,
        comm_threshold: float = 0.3,
        max_global_batch: int | None = None,
        lr_scaling: LrScaling | None = None,
        *,
        schedule_unit: ScheduleUnit = "step",
        micro_batch_size: int | None = None,
        base_global_batch: int | None = None,
        measure_steps: int = 8,
        verbose: bool = True,
    ) -> None:
        _check_arguments(target_global_batch, schedule, adaptive, comm_threshold,
                         max_global_batch, lr_scaling, schedule_unit, micro_batch_size,
                         base_global_batch, measure_steps, verbose)  # fmt: skip
        self.target_global_batch = target_global_batch
        self.schedule = check_schedule(schedule, schedule_unit) if schedule is not None else None
        self.schedule_unit = schedule_unit
        self.adaptive = adaptive
        self.comm_threshold = float(comm_threshold)
        self.max_global_batch = max_global_batch
        self.lr_scaling = lr_scaling
        self.micro_batch_size = micro_batch_size
        self.base_global_batch = base_global_batch
        self.measure_steps = measure_steps
        self.verbose = verbose
        self.history: list[AccumulationChange] = []
        self.measurements: list[CommShare] = []
        self._reset_fit_state()
        self._loaded: dict[str, Any] = {}

    def _reset_fit_state(self) -> None:
        self._windows = _new_windows(self)
        self._micro_changed = False  # by set_micro_batch_size, since setup
        self._engine: Any = None
        self._restore_loop: Callable[[], None] = _nothing  # puts Lightning's own back
        self._loaders: _combined.TrainLoaders | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Known before configure_optimizers (given, or the batch size of a loader passed
        to fit): trainer.estimated_stepping_batches, which LR schedulers size themselves
        from, counts the first window's accumulation. A loader from a hook is not built
        here: that would run the user's hook early."""
        if stage != "fit":
            return
        wiring.refuse_other_accumulation(trainer, pl_module)
        self._reset_fit_state()
        windows = self._windows
        self._restore_loop = wiring.take_over_windows(trainer, windows, self)
        micro = wiring.given_micro_batch(trainer, windows.micro)
        if micro is not None:
            trainer.accumulate_grad_batches = _first_accumulation(self, micro, trainer.world_size)

    def set_micro_batch_size(self, micro_batch_size: int) -> None:
        """Count micro-batches of this size from the fit's first window on.

        For a callback that changes the train loader's batch size as fit starts
        (:class:`~lightning_speedkit.MicroBatchTuner`): the accumulation then follows
        from the global batch. It holds until the next ``fit``.
        """
        self._windows.micro = _positive_int(micro_batch_size, "micro_batch_size")
        self._micro_changed = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A micro-batch set since setup (MicroBatchTuner's): Lightning reads the factor
        before the first window sets it, to tell whether a resumed epoch stopped
        mid-window (and to warn that a plain loader cannot resume mid-epoch)."""
        windows = self._windows
        windows.world = trainer.world_size
        self._engine = wiring.deepspeed_engine(trainer)
        self._loaders, micro = wiring.train_loaders(trainer)
        given, windows.micro = windows.micro, wiring.counted_micro(windows.micro, micro)
        if given and (self._micro_changed or given != windows.micro) and self._engine is None:
            trainer.accumulate_grad_batches = _first_accumulation(
                self, windows.micro or given, windows.world
            )
        windows.lr.hook(trainer.optimizers, self.lr_scaling)
        windows.timer.clock = Stamps(trainer.strategy.root_device)
        adaptive = self.adaptive and wiring.adaptive_applies(trainer)
        windows.policy_arguments = _policy_arguments(self, adaptive)
        windows.resume(self._loaded, self.adaptive)  # continue where a checkpoint was
        self._loaded = {}

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._windows.epoch_start(carries_over=wiring.engine_window_runs_on(trainer, self._engine))

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._windows.timer.gap()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._windows.micro_batch(trainer.global_step):
            self._start_window(trainer, batch, left=trainer.num_training_batches - batch_idx)
        if self._engine is not None:
            self._engine.set_gradient_accumulation_boundary(self._windows.done())
        self._windows.timer.micro_batch_start(synchronises=self._windows.done())

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._engine is not None:
            return  # DeepSpeed: called on every micro-batch; the engine keeps its window
        self._windows.timer.optimizer_step()
        wiring.rescale_short_window(optimizer, self._windows.accumulation, self._windows.had())

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._windows.timer.micro_batch_end(closes=self._windows.done())

    def _start_window(self, trainer: L.Trainer, batch: Any, left: float) -> None:
        """The collective (the broadcast in ``share``) is reached by every rank at the same
        window start, once per adaptive measurement. ``left``: the epoch's micro-batches
        from this one on."""
        windows = self._windows
        windows.micro = windows.micro or wiring.batch_micro(batch, self._loaders)
        share = wiring.from_rank_zero(trainer)
        change, measured = windows.open(
            trainer.global_step, trainer.current_epoch, trainer.global_rank == 0, share, left
        )
        if measured is not None:
            _keep_measurement(trainer, self.measurements, measured, windows)
        if change is not None:
            wiring.set_accumulation(trainer, self._engine, change.accumulation)
            _keep_change(trainer, self.history, change, windows, self.verbose)
        wiring.window_opened(self._engine, windows)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._restore_loop()
        self._restore_loop = _nothing
        self._windows.lr.remove()
        trainer.accumulate_grad_batches = 1

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self.teardown(trainer, pl_module, "fit")

    @property
    def comm_share(self) -> CommShare | None:
        """The latest adaptive measurement, or None before the first."""
        return self.measurements[-1] if self.measurements else None

    def state_dict(self) -> dict[str, Any]:
        return {
            **self._windows.state_dict(),
            "history": [asdict(change) for change in self.history],
            "measurements": [asdict(measured) for measured in self.measurements],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)
        self.history = [AccumulationChange(**c) for c in state_dict.get("history", [])]
        self.measurements = [CommShare(**m) for m in state_dict.get("measurements", [])]


def _nothing() -> None:
    """Nothing to put back (a module function: ``ddp_spawn`` pickles the callbacks)."""


def _policy_arguments(scheduler: AccumulationScheduler, adaptive: bool) -> dict[str, Any]:
    """:func:`~lightning_speedkit.schedule.policies.build_policy`'s arguments from the
    callback's; ``adaptive`` only where adaptive mode applies to the fit."""
    return {
        "schedule": scheduler.schedule,
        "unit": scheduler.schedule_unit,
        "target_global_batch": scheduler.target_global_batch,
        "max_global_batch": scheduler.max_global_batch if adaptive else None,
        "threshold": scheduler.comm_threshold,
    }


def _check_arguments(
    target_global_batch: int | None,
    schedule: Mapping[int, int] | None,
    adaptive: bool,
    comm_threshold: float,
    max_global_batch: int | None,
    lr_scaling: LrScaling | None,
    schedule_unit: ScheduleUnit,
    micro_batch_size: int | None,
    base_global_batch: int | None,
    measure_steps: int,
    verbose: bool,
) -> None:
    """AccumulationScheduler's arguments, each checked, and the modes they combine into."""
    if target_global_batch is not None:
        _positive_int(target_global_batch, "target_global_batch")
    _validation.choice("schedule_unit", schedule_unit, ("step", "epoch"))
    _validation.boolean("adaptive", adaptive)
    _validation.boolean("verbose", verbose)
    if schedule is not None:
        check_schedule(schedule, schedule_unit)
    if target_global_batch is None and schedule is None and not adaptive:
        raise SpeedkitConfigError(
            "AccumulationScheduler needs a mode: `target_global_batch=N`, "
            "`schedule={step: N, ...}`, or `adaptive=True` with `max_global_batch=N`."
        )
    if schedule is not None and (target_global_batch is not None or adaptive):
        raise SpeedkitConfigError(
            "`schedule` sets the global batch at every step by itself: it cannot be "
            "combined with `target_global_batch` or `adaptive`. Use one of them."
        )
    if adaptive and max_global_batch is None:
        raise SpeedkitConfigError(
            "`adaptive=True` needs `max_global_batch=N`: the largest global batch your "
            "optimisation tolerates, which adaptive mode never exceeds."
        )
    if max_global_batch is not None:
        _positive_int(max_global_batch, "max_global_batch")
        if not adaptive:
            raise SpeedkitConfigError(
                "`max_global_batch` is adaptive mode's ceiling; pass `adaptive=True` too, "
                "or leave it out."
            )
        if target_global_batch is not None and target_global_batch > max_global_batch:
            raise SpeedkitConfigError(
                f"`target_global_batch={target_global_batch}` is above "
                f"`max_global_batch={max_global_batch}`; adaptive mode starts at the "
                f"target and rises to the maximum."
            )
    share = "a share of the step, between 0 and 1"
    _validation.probability("comm_threshold", comm_threshold, low_open=True, high_open=True,
                            example=0.3, hint=share)  # fmt: skip
    _validation.choice("lr_scaling", lr_scaling, (*LR_POWER, None))
    for name, value in (("micro_batch_size", micro_batch_size),
                        ("base_global_batch", base_global_batch)):  # fmt: skip
        if value is not None:
            _positive_int(value, name)
    _positive_int(measure_steps, "measure_steps")


def _new_windows(scheduler: AccumulationScheduler) -> AccumulationWindows:
    """A fit's windows, before the fit says its world size and whether adaptive applies."""
    return AccumulationWindows(
        _policy_arguments(scheduler, adaptive=False),
        scheduler.micro_batch_size,
        1,
        scheduler.base_global_batch,
        scheduler.lr_scaling,
        scheduler.measure_steps,
    )


def _first_accumulation(scheduler: AccumulationScheduler, micro: int, world: int) -> int:
    """The accumulation of the fit's first window, known before it starts."""
    first = first_global_batch(micro, scheduler.schedule, scheduler.target_global_batch)
    return accumulation_for(first, micro, world)


def _keep_measurement(
    trainer: L.Trainer,
    measurements: list[CommShare],
    measured: CommShare,
    windows: AccumulationWindows,
) -> None:
    """Keep and log an adaptive measurement the policy has just taken."""
    measurements.append(measured)
    chose = windows.policy.accumulation(trainer.global_step) if windows.policy else 0
    log.debug("AccumulationScheduler measured %s, chose %d", measured, chose)
    log_metrics(trainer, {"accumulation/comm_share": measured.share})


def _keep_change(
    trainer: L.Trainer,
    history: list[AccumulationChange],
    change: AccumulationChange,
    windows: AccumulationWindows,
    verbose: bool,
) -> None:
    """Keep and log a change (the factor, the global batch, and the LR scale when
    scaling) and, when ``verbose``, say it (rank 0). One that only repeats the last kept
    (a resumed run taking up where it was) changes nothing."""
    last = history[-1] if history else None
    if last is not None and (last.accumulation, last.global_batch) == (
        change.accumulation,
        change.global_batch,
    ):
        return
    history.append(change)
    metrics = {"accumulation/factor": float(change.accumulation),
               "accumulation/global_batch": float(change.global_batch)}  # fmt: skip
    if windows.lr_scaling is not None:
        metrics["accumulation/lr_scale"] = windows.lr.factor
    log_metrics(trainer, metrics)
    if verbose:
        rank_zero_info(
            f"AccumulationScheduler: step {change.step}: {change.accumulation} micro-batch(es) "
            f"of {windows.micro} on {windows.world} rank(s) = global batch "
            f"{change.global_batch}" + (f" ({change.reason})" if change.reason else "")
        )
