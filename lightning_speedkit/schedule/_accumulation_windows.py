"""One fit's accumulation windows, Trainer-free: where each starts and ends, and its accumulation.

A window is the micro-batches of one optimizer step. Its first micro-batch asks the
fit's :mod:`~lightning_speedkit.schedule.policies` policy (built at the fit's first
window, for its micro-batch and world size) how many micro-batches the window gets;
a change of accumulation gives an :class:`AccumulationChange` and a new
learning-rate factor. For the adaptive policy it also times the windows
(:class:`~lightning_speedkit.schedule._window_timing.WindowTimer`) and, at a window's
start, hands the policy each measurement. AccumulationScheduler feeds it the optimizer
step of each micro-batch and wires its answers into Lightning (or DeepSpeed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_speedkit.schedule._lr_scaling import LrScaler, LrScaling, lr_factor
from lightning_speedkit.schedule._window_timing import WindowTimer
from lightning_speedkit.schedule.policies import (
    AccumulationPolicy,
    AdaptiveToCommunication,
    CommShare,
    build_policy,
)


@dataclass(frozen=True)
class AccumulationChange:
    """One change of the accumulation, as logged and kept in checkpoints."""

    step: int
    """The optimizer step (``trainer.global_step``) from which it applies."""
    accumulation: int
    global_batch: int
    reason: str


class AccumulationWindows:
    """Counts micro-batches into windows and asks the policy at each window's first.

    Args:
        policy_arguments: :func:`~lightning_speedkit.schedule.policies.build_policy`'s
            keyword arguments but the sizes and a resumed run's state.
        micro_batch: samples per micro-batch on one rank; None until known (the caller
            sets :attr:`micro` before the first window).
        world_size: the number of ranks.
        base_global_batch: the global batch the learning rate was tuned for; by default
            the first window's.
        lr_scaling: how :attr:`lr`'s factor follows the global batch (None: it stays 1).
        measure_steps: timed windows per adaptive measurement.

    Example::

        >>> windows = AccumulationWindows({"schedule": {0: 16, 2: 32}}, micro_batch=8)
        >>> steps = [0, 0, 1, 1, 2, 2, 2, 2]  # the optimizer step of each micro-batch
        >>> opened = []
        >>> for step in steps:
        ...     if windows.micro_batch(step):
        ...         change, _ = windows.open(step)
        ...         opened.append((step, windows.accumulation, change is not None))
        >>> opened
        [(0, 2, True), (1, 2, False), (2, 4, True)]
    """

    def __init__(
        self,
        policy_arguments: dict[str, Any],
        micro_batch: int | None = None,
        world_size: int = 1,
        base_global_batch: int | None = None,
        lr_scaling: LrScaling | None = None,
        measure_steps: int = 8,
    ) -> None:
        self.policy_arguments = policy_arguments
        self.micro = micro_batch
        self.world = world_size
        self.base = base_global_batch
        self.lr_scaling = lr_scaling
        self.lr = LrScaler()
        self.timer = WindowTimer()  # its clock is set when the fit's device is known
        self.measure_steps = measure_steps
        self.accumulation = 0  # 0: no window yet this fit
        self.length = 0  # the open window's micro-batches: fewer at an epoch's end
        self.count = 0  # micro-batches in the open window, this one included
        self.lost = 0  # of those, run before the checkpoint a resumed fit continues from
        self.step = -1  # the optimizer step the open window began at
        self.policy: AccumulationPolicy | None = None
        self.resumed: dict[str, Any] = {}  # a checkpoint's adaptive state, for the policy
        self.resumed_window: dict[str, int] | None = None  # the window it was saved in

    def done(self) -> bool:
        """Whether the micro-batch running now closes its window."""
        return self.count >= self.length

    def had(self) -> int:
        """The open window's micro-batches whose gradients the step has: all of them but
        those run before the checkpoint a resumed fit continued mid-window from (a
        checkpoint does not hold gradients)."""
        return self.count - self.lost

    def starts(self) -> bool:
        """Whether the micro-batch running now opens its window (zero the gradients)."""
        return self.count == 1

    def global_batch(self, accumulation: int) -> int:
        return accumulation * (self.micro or 1) * self.world

    def epoch_start(self, carries_over: bool = False) -> None:
        """A training epoch starts: the last window closed at the last epoch's end, so a
        window starts afresh, unless it ``carries_over`` (DeepSpeed, where an epoch's
        length is not known: the engine's window runs on)."""
        if not carries_over:
            self.count = 0
        self.timer.gap()

    def micro_batch(self, step: int) -> bool:
        """A micro-batch starts at optimizer step ``step``: whether it opens a window
        (then call :meth:`open`); otherwise it is counted into the open one."""
        if self.accumulation == 0 or self.done() or step != self.step:
            return True
        self.count += 1
        return False

    def open(
        self,
        step: int,
        epoch: int = 0,
        measures: bool = True,
        share: Callable[[CommShare | None], CommShare | None] = lambda measured: measured,
        left: float = float("inf"),
    ) -> tuple[AccumulationChange | None, CommShare | None]:
        """Open the window at ``step``: (the change, when its accumulation differs from
        the last window's; the adaptive measurement handed to the policy now, if any).
        ``left``: the epoch's micro-batches from this one on; fewer than the accumulation
        make a short window (:attr:`length`), which closes at the epoch's last.

        The policy is built at the first window. An adaptive policy first gets a
        measurement once enough windows were timed: made where ``measures`` (rank 0)
        and handed to every rank by ``share`` (a broadcast), so that all decide alike.
        """
        measured = None
        if self.policy is None:
            micro = self.micro or 1
            self.policy = build_policy(micro, self.world, **self.policy_arguments, **self.resumed)
        elif isinstance(self.policy, AdaptiveToCommunication):
            ready, measured = self.timer.take_measurement(self.measure_steps, measures, share)
            if ready:
                self.policy.observe(measured, step)
        accumulation = self.policy.accumulation(step, epoch)
        self.count, self.step, self.lost = 1, step, 0
        self.length = int(min(accumulation, max(left, 1)))
        window, self.resumed_window = self.resumed_window, None
        if window is not None and window["step"] == step:  # continue it, edges kept
            # the saved window, but no longer than what is left of the epoch now (another
            # `limit_train_batches`): it must close at the epoch's last micro-batch
            self.lost = window["count"]
            self.length = min(window["length"], self.lost + self.length)
            self.count += self.lost
        change = None if accumulation == self.accumulation else self._change(step, accumulation)
        policy = self.policy
        if isinstance(policy, AdaptiveToCommunication) and policy.measures(step):
            self.timer.open_window(self.accumulation)
        else:
            self.timer.open = None
        return change, measured

    def _change(self, step: int, accumulation: int) -> AccumulationChange:
        """Take up a new accumulation: the LR factor follows; earlier timings no longer apply."""
        assert self.policy is not None  # built before any accumulation is asked
        self.accumulation = accumulation
        global_batch = self.global_batch(accumulation)
        self.base = self.base or global_batch
        if self.lr_scaling is not None:
            self.lr.factor = lr_factor(global_batch, self.base, self.lr_scaling)
        self.timer.clear()
        return AccumulationChange(step, accumulation, global_batch, self.policy.reason)

    def resume(self, state: dict[str, Any], adaptive: bool) -> None:
        """Continue where a checkpoint's :meth:`state_dict` was (before the first window)."""
        self.base = self.base or state.get("base_global_batch")
        self.resumed = {
            "probed": bool(state.get("probed", False)),
            "next_check": int(state.get("next_check", 0)),
        }
        if adaptive:
            self.resumed["resumed_global_batch"] = state.get("global_batch")
        self.resumed_window = state.get("window")

    def state_dict(self) -> dict[str, Any]:
        """The accumulation, global batches and adaptive state, as checkpoints keep them;
        and the open window's place, where a checkpoint is taken mid-window."""
        policy = self.policy if isinstance(self.policy, AdaptiveToCommunication) else None
        resumed = {"probed": False, "next_check": 0, **self.resumed}
        window = {"step": self.step, "count": self.count, "length": self.length}
        return {
            **({"window": window} if 0 < self.count < self.length else {}),
            "accumulation": self.accumulation,
            "global_batch": self.global_batch(self.accumulation) if self.accumulation else None,
            "base_global_batch": self.base,
            "probed": policy.probed if policy is not None else resumed["probed"],
            "next_check": policy.next_check if policy is not None else resumed["next_check"],
        }
