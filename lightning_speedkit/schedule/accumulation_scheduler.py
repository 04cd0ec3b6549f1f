"""AccumulationScheduler: accumulation by global batch, by schedule, or by communication share."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from torch.nn.parallel import DistributedDataParallel

from lightning_speedkit import _combined, _compat, _validation
from lightning_speedkit._optimizers import torch_optimizer
from lightning_speedkit.errors import SpeedkitConfigError
from lightning_speedkit.measure._clock import Stamps
from lightning_speedkit.schedule.policies import (
    AccumulationPolicy,
    AdaptiveToCommunication,
    CommShare,
    ScheduleUnit,
    StepSchedule,
    TargetGlobalBatch,
    accumulation_for,
    check_schedule,
)

__all__ = ["AccumulationChange", "AccumulationScheduler", "CommShare", "accumulation_for"]

log = logging.getLogger(__name__)

LrScaling = Literal["linear", "sqrt"]
_LR_POWER: dict[str, float] = {"linear": 1.0, "sqrt": 0.5}
_WARMUP_WINDOWS = 2  # optimizer steps left out of a measurement after fit starts


@dataclass(frozen=True)
class AccumulationChange:
    """One change of the accumulation, as logged and kept in checkpoints."""

    step: int
    """The optimizer step (``trainer.global_step``) from which it applies."""
    accumulation: int
    global_batch: int
    reason: str


@dataclass
class _Window:
    """Timestamps of one accumulation window (host seconds, or CUDA events)."""

    accumulation: int
    previous_end: Any
    unsynced: list[tuple[Any, Any]] = field(default_factory=list)
    sync_start: Any = None
    synced: Any = None
    end: Any = None
    tainted: bool = False


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _measure(windows: list[_Window], clock: Stamps) -> CommShare | None:
    """Turn complete, untainted windows of one accumulation into a CommShare."""
    usable = [
        w
        for w in windows
        if not w.tainted and w.previous_end is not None and w.end is not None and w.unsynced
    ]
    if not usable:
        return None
    clock.wait(usable[-1].end)
    micro = _median([clock.seconds(s, e) for w in usable for s, e in w.unsynced])
    synced = _median([clock.seconds(w.sync_start, w.synced) for w in usable])
    return CommShare(
        accumulation=usable[0].accumulation,
        step_s=_median([clock.seconds(w.previous_end, w.end) for w in usable]),
        micro_batch_s=micro,
        comm_s=max(0.0, synced - micro),
        optimizer_s=_median([clock.seconds(w.synced, w.end) for w in usable]),
    )


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
    the fit's micro-batch and world size and asked at each window's first micro-batch;
    this callback counts the windows, times them for the adaptive policy, and wires the
    answer into Lightning.

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
        if target_global_batch is not None:
            _positive_int(target_global_batch, "target_global_batch")
        _validation.choice("schedule_unit", schedule_unit, ("step", "epoch"))
        _validation.boolean("adaptive", adaptive)
        _validation.boolean("verbose", verbose)
        if schedule is not None:
            schedule = check_schedule(schedule, schedule_unit)
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
        _validation.choice("lr_scaling", lr_scaling, (*_LR_POWER, None))
        for name, value in (("micro_batch_size", micro_batch_size),
                            ("base_global_batch", base_global_batch)):  # fmt: skip
            if value is not None:
                _positive_int(value, name)
        _positive_int(measure_steps, "measure_steps")

        self.target_global_batch = target_global_batch
        self.schedule = schedule
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
        self._micro: int | None = self.micro_batch_size
        self._micro_changed = False  # by set_micro_batch_size, since setup
        self._world = 1
        self._accumulation = 0  # 0: no window yet this fit
        self._count = 0  # micro-batches in the open window, this batch included
        self._window_step = -1  # trainer.global_step when the open window began
        self._base: int | None = self.base_global_batch
        self._lr_factor = 1.0
        self._engine: Any = None
        self._restore_loop: Any = None
        self._hooks: list[Any] = []
        self._saved_lrs: dict[int, list[float]] = {}
        # the policy answers how many micro-batches each window gets; built at the first window
        self._policy: AccumulationPolicy | None = None
        self._adaptive_on = False
        self._probed = False  # carried through checkpoints when no adaptive policy runs
        self._next_check = 0
        self._resumed_global_batch: int | None = None
        # timing for the adaptive policy's measurements
        self._clock: Stamps | None = None
        self._loaders: _combined.TrainLoaders | None = None
        self._windows: list[_Window] = []
        self._open: _Window | None = None
        self._last_end: Any = None

    # -- set-up ---------------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
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
        self._reset_fit_state()
        self._restore_loop = _compat.take_over_accumulation(
            trainer, self._window_done, self._window_starts
        )
        # Known before configure_optimizers (given, or the batch size of a loader passed to
        # fit): trainer.estimated_stepping_batches, which LR schedulers size themselves
        # from, counts the first window's accumulation. A loader from a hook is not built
        # here: that would run the user's hook early.
        given = _combined.given(_compat.train_loader_source(trainer).instance)
        _refuse_shrinking_batches(given)
        micro = self._micro or _micro_batch(given)
        if micro is not None:
            trainer.accumulate_grad_batches = accumulation_for(
                self._first_global_batch(micro), micro, trainer.world_size
            )

    def _first_global_batch(self, micro: int) -> int:
        if self.schedule is not None:
            start = [batch for key, batch in self.schedule.items() if key == 0]
            return start[0] if start else micro
        return self.target_global_batch or micro

    def set_micro_batch_size(self, micro_batch_size: int) -> None:
        """Count micro-batches of this size from the fit's first window on.

        For a callback that changes the train loader's batch size as fit starts
        (:class:`~lightning_speedkit.MicroBatchTuner`): the accumulation then follows
        from the global batch. It holds until the next ``fit``.
        """
        self._micro = _positive_int(micro_batch_size, "micro_batch_size")
        self._micro_changed = True

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._world = trainer.world_size
        if isinstance(trainer.strategy, DeepSpeedStrategy):
            self._engine = trainer.strategy.deepspeed_engine
        self._loaders = _combined.of_trainer(trainer)
        if self._loaders is not None:
            _refuse_shrinking_batches(self._loaders)
        if self._micro is None:
            self._micro = _micro_batch(self._loaders) if self._loaders is not None else None
        elif self._micro_changed and self._engine is None:
            # A micro-batch set since setup (MicroBatchTuner's): Lightning reads the factor
            # before the first window sets it, to tell whether a resumed epoch stopped
            # mid-window (and to warn that a plain loader cannot resume mid-epoch).
            trainer.accumulate_grad_batches = accumulation_for(
                self._first_global_batch(self._micro), self._micro, trainer.world_size
            )
        if self.lr_scaling is not None:
            self._hook_optimizers(trainer)
        self._clock = Stamps(trainer.strategy.root_device)
        if self.adaptive:
            self._adaptive_on = self._adaptive_applies(trainer)
        loaded, self._loaded = self._loaded, {}
        if loaded:
            self._restore(loaded)

    def _adaptive_applies(self, trainer: L.Trainer) -> bool:
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

    def _hook_optimizers(self, trainer: L.Trainer) -> None:
        for optimizer in trainer.optimizers:
            inner = torch_optimizer(optimizer)
            if inner is None:
                raise SpeedkitConfigError(
                    f"`lr_scaling={self.lr_scaling!r}` needs a torch.optim.Optimizer, got "
                    f"{type(optimizer).__name__}. Scale the learning rate yourself, or use a "
                    f"torch optimizer."
                )
            self._hooks.append(inner.register_step_pre_hook(self._scale_lr))
            self._hooks.append(inner.register_step_post_hook(self._unscale_lr))

    def _scale_lr(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._lr_factor == 1.0:
            return
        self._saved_lrs[id(optimizer)] = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * self._lr_factor

    def _unscale_lr(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        saved = self._saved_lrs.pop(id(optimizer), None)
        if saved is not None:  # the exact values back, not lr * f / f
            for group, lr in zip(optimizer.param_groups, saved, strict=True):
                group["lr"] = lr

    # -- the window, per batch (host-side bookkeeping only) ---------------------------------------

    def _window_done(self) -> bool:
        return self._count >= self._accumulation

    def _window_starts(self) -> bool:
        return self._count == 1

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._engine is None:
            self._count = 0  # Lightning stepped on the last batch; DeepSpeed carries over
        self._gap()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._gap()

    def _gap(self) -> None:
        """Time spent outside training batches (validation, epoch end) is not a step's."""
        if self._open is not None:
            self._open.tainted = True
        self._last_end = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        new_window = (
            self._accumulation == 0
            or self._count >= self._accumulation
            or trainer.global_step != self._window_step
        )
        if new_window:
            self._start_window(trainer, batch)
        else:
            self._count += 1
        if self._engine is not None:
            self._engine.set_gradient_accumulation_boundary(self._count >= self._accumulation)
        if self._open is not None:
            now = self._clock.now() if self._clock is not None else None
            if self._count < self._accumulation:
                self._open.unsynced.append((now, None))
            else:
                self._open.sync_start = now

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._engine is not None:
            return  # DeepSpeed: called on every micro-batch; the engine keeps its window
        if self._open is not None and self._clock is not None:
            self._open.synced = self._clock.now()
        if 0 < self._count < self._accumulation:
            # The epoch's last window ran short: Lightning divided each loss by the full
            # accumulation. Make the step the mean over the micro-batches it really had.
            scale = self._accumulation / self._count
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        if param.grad is not None:
                            param.grad.mul_(scale)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        window = self._open
        if window is None or self._clock is None:
            return
        now = self._clock.now()
        if window.unsynced and window.unsynced[-1][1] is None:
            start, _ = window.unsynced[-1]
            window.unsynced[-1] = (start, now)
        if self._count >= self._accumulation:
            window.end = now
            self._windows.append(window)
            self._open = None
            self._last_end = now

    # -- deciding the accumulation (at window starts only) ------------------------------------

    def _start_window(self, trainer: L.Trainer, batch: Any) -> None:
        if self._micro is None:  # the loaders do not say: this batch does
            parts = self._loaders.parts(batch) if self._loaders is not None else [batch]
            self._micro = sum(int(extract_batch_size(part)) for part in parts)
        if self._policy is None:  # the fit's first window
            self._policy = self._make_policy()
        elif isinstance(self._policy, AdaptiveToCommunication):
            self._observe(trainer, self._policy)
        policy = self._policy
        accumulation = policy.accumulation(trainer.global_step, trainer.current_epoch)
        self._count = 1
        self._window_step = trainer.global_step
        if accumulation != self._accumulation:
            self._apply(trainer, accumulation, policy.reason)
        timed = isinstance(policy, AdaptiveToCommunication) and policy.measures(trainer.global_step)
        self._open = _Window(self._accumulation, self._last_end) if timed else None

    def _make_policy(self) -> AccumulationPolicy:
        """The policy the constructor's arguments ask for, for this fit's sizes."""
        micro = self._micro or 1
        if self.schedule is not None:
            return StepSchedule(self.schedule, micro, self._world, self.schedule_unit)
        start = TargetGlobalBatch(self.target_global_batch, micro, self._world)
        if not self._adaptive_on:  # not adaptive, or adaptive where it cannot apply
            return start
        assert self.max_global_batch is not None  # the constructor requires it with adaptive
        return AdaptiveToCommunication(
            start,
            self.max_global_batch,
            self.comm_threshold,
            resumed_global_batch=self._resumed_global_batch,
            probed=self._probed,
            next_check=self._next_check,
        )

    def _global_batch(self, accumulation: int) -> int:
        return accumulation * (self._micro or 1) * self._world

    def _observe(self, trainer: L.Trainer, policy: AdaptiveToCommunication) -> None:
        """Measure the timed windows once there are enough, and give the policy the result."""
        usable = [w for w in self._windows[_WARMUP_WINDOWS:] if not w.tainted]
        if len(usable) < self.measure_steps:
            return
        measured: CommShare | None = None
        if trainer.global_rank == 0:
            assert self._clock is not None
            measured = _measure(usable, self._clock)
        # collective: every rank reaches this window start together; once per measurement.
        # Every rank's policy then makes rank 0's decision from the same numbers.
        measured = trainer.strategy.broadcast(measured, src=0)
        self._windows = []
        policy.observe(measured, trainer.global_step)
        if measured is None:
            return
        self.measurements.append(measured)
        log.debug(
            "AccumulationScheduler measured %s, chose %d",
            measured,
            policy.accumulation(trainer.global_step),
        )
        self._log(trainer, {"accumulation/comm_share": measured.share})

    def _apply(self, trainer: L.Trainer, accumulation: int, reason: str) -> None:
        self._accumulation = accumulation
        global_batch = self._global_batch(accumulation)
        if self._base is None:
            self._base = global_batch
        if self.lr_scaling is not None:
            self._lr_factor = (global_batch / self._base) ** _LR_POWER[self.lr_scaling]
        if self._engine is not None:
            # DeepSpeed divides the loss by its own accumulation: Lightning must not too.
            trainer.accumulate_grad_batches = 1
            engine = self._engine
            engine.set_train_batch_size(
                engine.train_micro_batch_size_per_gpu() * engine.dp_world_size * accumulation
            )
        else:
            trainer.accumulate_grad_batches = accumulation  # Lightning's loss divisor
        self._windows = []
        self._open = None
        last = self.history[-1] if self.history else None
        if last is not None and (last.accumulation, last.global_batch) == (
            accumulation,
            global_batch,
        ):
            return  # a resumed run taking up where it was: nothing changed
        change = AccumulationChange(trainer.global_step, accumulation, global_batch, reason)
        self.history.append(change)
        metrics = {"accumulation/factor": float(accumulation),
                   "accumulation/global_batch": float(global_batch)}  # fmt: skip
        if self.lr_scaling is not None:
            metrics["accumulation/lr_scale"] = self._lr_factor
        self._log(trainer, metrics)
        if self.verbose:
            rank_zero_info(
                f"AccumulationScheduler: step {change.step}: {accumulation} micro-batch(es) of "
                f"{self._micro} on {self._world} rank(s) = global batch {global_batch}"
                + (f" ({reason})" if reason else "")
            )

    @staticmethod
    def _log(trainer: L.Trainer, metrics: dict[str, float]) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # -- teardown and checkpoints ---------------------------------------------------------------

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self._restore_loop is not None:
            self._restore_loop()
            self._restore_loop = None
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
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
        policy = self._policy if isinstance(self._policy, AdaptiveToCommunication) else None
        return {
            "accumulation": self._accumulation,
            "global_batch": self._global_batch(self._accumulation) if self._accumulation else None,
            "base_global_batch": self._base,
            "probed": policy.probed if policy is not None else self._probed,
            "next_check": policy.next_check if policy is not None else self._next_check,
            "history": [asdict(change) for change in self.history],
            "measurements": [asdict(measured) for measured in self.measurements],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)
        self.history = [AccumulationChange(**c) for c in state_dict.get("history", [])]
        self.measurements = [CommShare(**m) for m in state_dict.get("measurements", [])]

    def _restore(self, state: dict[str, Any]) -> None:
        """Continue where the checkpoint was (called at train start, after set-up)."""
        self._base = self.base_global_batch or state.get("base_global_batch")
        self._probed = bool(state.get("probed", False))
        self._next_check = int(state.get("next_check", 0))
        if self.adaptive:
            self._resumed_global_batch = state.get("global_batch")


def _micro_batch(loaders: _combined.TrainLoaders) -> int | None:
    """Samples one step of the train loaders holds on one rank, if the loaders say: a
    step of a dict or list of loaders holds a batch of each."""
    sizes = [_combined.loader_batch_size(loader) for loader in loaders.flat()]
    if not sizes or any(size is None for size in sizes):
        return None
    if not loaders.combined:  # one loader, or one loader's batch a step ("sequential")
        return sizes[0] if len(set(sizes)) == 1 else None
    return sum(size or 0 for size in sizes)


def _refuse_shrinking_batches(loaders: _combined.TrainLoaders) -> None:
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
