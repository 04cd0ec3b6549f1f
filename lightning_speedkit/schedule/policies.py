"""Accumulation policies: how many micro-batches the optimizer step that starts now takes.

Each policy answers one question, ``accumulation(step, epoch)``, and says why in
``reason``. :class:`~lightning_speedkit.AccumulationScheduler` asks it at the first
micro-batch of each window and does the rest: it counts the windows, times them for
:class:`AdaptiveToCommunication` and hands it each measurement through ``observe``,
and wires the answer into Lightning (or DeepSpeed). The policies need no Trainer: a
policy is built for one micro-batch size and world size, and speaks global batches
(samples per optimizer step over all ranks), as the callback's arguments do.

- :class:`TargetGlobalBatch`: one global batch at every step.
- :class:`StepSchedule`: a global batch per optimizer step (or epoch) from a key on.
- :class:`AdaptiveToCommunication`: starts at a :class:`TargetGlobalBatch` and raises
  the accumulation while the measured :class:`CommShare` is above a threshold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from lightning.pytorch.utilities import rank_zero_warn

from lightning_speedkit import _validation
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = [
    "AccumulationPolicy",
    "AdaptiveToCommunication",
    "CommShare",
    "StepSchedule",
    "TargetGlobalBatch",
    "accumulation_for",
]

ScheduleUnit = Literal["step", "epoch"]
RECHECK_STEPS = 100
"""Once a measurement leaves the accumulation as it is, the next is due this many steps later."""


def accumulation_for(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-batches per optimizer step that come closest to ``global_batch`` (at least 1).

    Example::

        >>> accumulation_for(256, micro_batch=8, world_size=4)
        8
        >>> accumulation_for(100, micro_batch=8, world_size=4)  # 96 samples: the closest
        3
    """
    return max(1, math.floor(global_batch / (micro_batch * world_size) + 0.5))


@dataclass(frozen=True)
class CommShare:
    """How much of an optimizer step is communication nobody overlapped, measured.

    Medians over several optimizer steps of ``accumulation`` micro-batches each. The
    micro-batches that run under DDP's ``no_sync`` give the forward and backward time
    of one micro-batch without gradient traffic; the one that synchronises takes longer
    by the all-reduce time that backward did not hide. That difference is ``comm_s``.
    """

    accumulation: int
    step_s: float
    """Wall time of one optimizer step: loading, forward, backward, sync, optimizer."""
    micro_batch_s: float
    """Forward and backward of one micro-batch under ``no_sync``."""
    comm_s: float
    """Exposed communication per optimizer step."""
    optimizer_s: float
    """The optimizer step itself."""

    @property
    def share(self) -> float:
        """Exposed communication as a fraction of the step."""
        return self.comm_s / self.step_s if self.step_s > 0 else 0.0

    def _per_micro_batch(self) -> float:
        return max(0.0, self.step_s - self.comm_s - self.optimizer_s) / self.accumulation

    def predicted_share(self, accumulation: int) -> float:
        """The share at another accumulation.

        Communication and the optimizer step are paid once per optimizer step; loading,
        forward and backward once per micro-batch.
        """
        step = accumulation * self._per_micro_batch() + self.comm_s + self.optimizer_s
        return self.comm_s / step if step > 0 else 0.0

    def smallest_accumulation(self, threshold: float, lowest: int, highest: int) -> int:
        """The smallest accumulation in ``[lowest, highest]`` predicted at or below ``threshold``.

        ``share(k) <= t`` solves to ``k >= (comm (1 - t) / t - optimizer) / micro``; when no
        accumulation up to ``highest`` gets there, ``highest``.
        """
        per_micro = self._per_micro_batch()
        if self.comm_s <= threshold * (self.comm_s + self.optimizer_s):
            return lowest  # under the threshold at any accumulation
        if per_micro <= 0:
            return highest
        needed = (self.comm_s * (1 - threshold) / threshold - self.optimizer_s) / per_micro
        return min(highest, max(lowest, math.ceil(needed - 1e-9)))


class AccumulationPolicy(Protocol):
    """What AccumulationScheduler asks at the first micro-batch of each window."""

    @property
    def reason(self) -> str:
        """Why the latest answer, as the callback logs and keeps it."""
        ...

    def accumulation(self, step: int, epoch: int = 0) -> int:
        """Micro-batches for the window that starts at optimizer step ``step`` of ``epoch``."""
        ...


def check_schedule(schedule: Mapping[int, int], unit: str) -> dict[int, int]:
    """``schedule`` checked (keys from 0, positive global batches) and sorted by key."""
    if not isinstance(schedule, Mapping) or not schedule:
        raise SpeedkitConfigError(
            f"`schedule` must be a non-empty dict of {unit} -> global batch, e.g. "
            f"{{0: 64, 1000: 256}}; got {schedule!r}."
        )
    checked: dict[int, int] = {}
    for key, value in schedule.items():
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise SpeedkitConfigError(
                f"`schedule` keys are {unit}s counted from 0; got {key!r}. Use ints, e.g. "
                f"{{0: 64, 1000: 256}}."
            )
        checked[key] = _validation.positive_int(f"schedule[{key}]", value, example=64)
    return dict(sorted(checked.items()))


class _Sizes:
    """Global batch and accumulation, one into the other, for one micro-batch and world size."""

    def __init__(self, micro_batch: int, world_size: int) -> None:
        self.micro_batch = _validation.positive_int("micro_batch", micro_batch, example=8)
        self.world_size = _validation.positive_int("world_size", world_size, example=1)
        self._warned: set[int] = set()

    def global_batch(self, accumulation: int) -> int:
        return accumulation * self.micro_batch * self.world_size

    def accumulation(self, global_batch: int) -> int:
        """The closest accumulation; one warning per global batch that it cannot make."""
        accumulation = accumulation_for(global_batch, self.micro_batch, self.world_size)
        used = self.global_batch(accumulation)
        if used != global_batch and global_batch not in self._warned:
            self._warned.add(global_batch)
            rank_zero_warn(
                f"AccumulationScheduler: a global batch of {global_batch} cannot be made of "
                f"micro-batches of {self.micro_batch} on {self.world_size} rank(s); using "
                f"{accumulation} micro-batch(es) per step, a global batch of {used}."
            )
        return accumulation


class TargetGlobalBatch:
    """The same global batch at every step: ``global_batch / (micro_batch x world_size)``.

    A global batch the micro-batch and world size cannot make exactly is rounded to the
    closest (:func:`accumulation_for`), with one warning naming the one used.

    Args:
        global_batch: samples per optimizer step over all ranks; ``None`` for one
            micro-batch per step (adaptive mode's start without a target).
        micro_batch: samples per micro-batch on one rank.
        world_size: the number of ranks.

    Example::

        >>> policy = TargetGlobalBatch(256, micro_batch=8, world_size=4)
        >>> policy.accumulation(step=0), policy.reason
        (8, 'target global batch 256')
    """

    def __init__(self, global_batch: int | None, micro_batch: int, world_size: int) -> None:
        self._sizes = _Sizes(micro_batch, world_size)
        self.global_batch = global_batch
        if global_batch is None:
            self._accumulation, self._reason = 1, "one micro-batch per step"
        else:
            global_batch = _validation.positive_int("global_batch", global_batch, example=256)
            self._accumulation = self._sizes.accumulation(global_batch)
            self._reason = f"target global batch {global_batch}"

    @property
    def reason(self) -> str:
        return self._reason

    def accumulation(self, step: int, epoch: int = 0) -> int:
        return self._accumulation


class StepSchedule:
    """A global batch from each key on: ``{step (or epoch): global batch}``.

    Before the first key, one micro-batch per step. Each global batch is rounded as
    :class:`TargetGlobalBatch` rounds it (one warning per global batch).

    Args:
        schedule: ``{key: global batch}``, keys counted from 0.
        micro_batch: samples per micro-batch on one rank.
        world_size: the number of ranks.
        unit: what the keys count, optimizer steps (``"step"``) or epochs (``"epoch"``).

    Example::

        >>> policy = StepSchedule({0: 64, 1000: 256}, micro_batch=8, world_size=4)
        >>> policy.accumulation(step=999), policy.accumulation(step=1000), policy.reason
        (2, 8, 'schedule[1000] = 256')
    """

    def __init__(
        self,
        schedule: Mapping[int, int],
        micro_batch: int,
        world_size: int,
        unit: ScheduleUnit = "step",
    ) -> None:
        self.unit: ScheduleUnit = _validation.choice("unit", unit, ("step", "epoch"))
        self.schedule = check_schedule(schedule, self.unit)
        self._sizes = _Sizes(micro_batch, world_size)
        self._reason = ""

    @property
    def reason(self) -> str:
        return self._reason

    def accumulation(self, step: int, epoch: int = 0) -> int:
        where = step if self.unit == "step" else epoch
        keys = [key for key in self.schedule if key <= where]
        if not keys:
            self._reason = "before the schedule's first key"
            return 1
        value = self.schedule[keys[-1]]
        self._reason = f"schedule[{keys[-1]}] = {value}"
        return self._sizes.accumulation(value)


class AdaptiveToCommunication:
    """Raise the accumulation while exposed communication is above ``threshold`` of the step.

    Starts at ``start``'s accumulation, its floor. From a floor of one micro-batch it
    first asks for two (a probe: the measurement needs one unsynchronised micro-batch)
    and may go back to one after the first measurement. Each measurement given to
    :meth:`observe` moves it to the smallest accumulation :class:`CommShare` predicts at
    or below the threshold, never below the current one (after the probe: the floor),
    never above ``max_global_batch``. A measurement that leaves it where it is puts
    the next one ``RECHECK_STEPS`` (100) steps later: see :meth:`measures`.

    Args:
        start: where it starts and the lowest it goes.
        max_global_batch: the ceiling, rounded down to whole micro-batches.
        threshold: the exposed-communication share accepted (0 to 1).
        resumed_global_batch: a resumed run's global batch: start there (within floor
            and ceiling) instead, without probing.
        probed: the run probed already (a resumed run): do not probe again.
        next_check: the first optimizer step whose window may be measured.

    Example::

        >>> policy = AdaptiveToCommunication(TargetGlobalBatch(None, micro_batch=8,
        ...                                  world_size=2), max_global_batch=256)
        >>> policy.accumulation(step=0)  # the probe
        2
        >>> slow = CommShare(accumulation=2, step_s=0.052, micro_batch_s=0.001, comm_s=0.05,
        ...                  optimizer_s=0.0)
        >>> policy.observe(slow, step=5)
        >>> policy.accumulation(step=5)  # 256 / (8 x 2): the most it may take
        16
    """

    def __init__(
        self,
        start: TargetGlobalBatch,
        max_global_batch: int,
        threshold: float = 0.3,
        *,
        resumed_global_batch: int | None = None,
        probed: bool = False,
        next_check: int = 0,
    ) -> None:
        self.threshold = _validation.probability("threshold", threshold, low_open=True,
                                                 high_open=True, example=0.3)  # fmt: skip
        self._sizes = start._sizes
        self.floor = start.accumulation(0)
        max_global_batch = _validation.positive_int("max_global_batch", max_global_batch)
        self.ceiling = max(self.floor, max_global_batch // self._sizes.global_batch(1))
        self.probed = probed
        self.next_check = next_check
        self._probing = False
        if resumed_global_batch is not None:
            resumed = self._sizes.accumulation(resumed_global_batch)
            self._accumulation = min(self.ceiling, max(self.floor, resumed))
            self._reason = f"resumed at global batch {resumed_global_batch}"
        elif self.floor == 1 and self.ceiling >= 2 and not probed:
            self.probed = self._probing = True
            self._accumulation = 2
            self._reason = "adaptive probe: one unsynchronised micro-batch to measure communication"
        else:
            self._accumulation, self._reason = self.floor, start.reason

    @property
    def reason(self) -> str:
        return self._reason

    def accumulation(self, step: int, epoch: int = 0) -> int:
        return self._accumulation

    def measures(self, step: int) -> bool:
        """Whether to time the window that starts at ``step`` for the next measurement."""
        return self._accumulation > 1 and step >= self.next_check

    def observe(self, measured: CommShare | None, step: int) -> None:
        """Take a measurement made up to optimizer step ``step`` (``None``: none came out)."""
        probing, self._probing = self._probing, False
        if measured is None:
            return
        # After the probe the floor is open again; later, accumulation only rises.
        lowest = self.floor if probing else self._accumulation
        chosen = measured.smallest_accumulation(self.threshold, lowest, self.ceiling)
        if chosen == self._accumulation:
            self.next_check = step + RECHECK_STEPS
            return
        predicted = measured.predicted_share(chosen)
        capped = " (the most `max_global_batch` allows)" if predicted > self.threshold else ""
        self._accumulation = chosen
        self._reason = (
            f"communication {measured.share:.0%} of the step at accumulation "
            f"{measured.accumulation} (threshold {self.threshold:.0%}); predicted "
            f"{predicted:.0%} at {chosen}{capped}"
        )


def build_policy(
    micro_batch: int,
    world_size: int,
    *,
    schedule: Mapping[int, int] | None = None,
    unit: ScheduleUnit = "step",
    target_global_batch: int | None = None,
    max_global_batch: int | None = None,
    threshold: float = 0.3,
    resumed_global_batch: int | None = None,
    probed: bool = False,
    next_check: int = 0,
) -> AccumulationPolicy:
    """The policy AccumulationScheduler's arguments ask for, for one fit's sizes.

    ``schedule`` gives a :class:`StepSchedule`; otherwise ``max_global_batch`` (adaptive
    mode, where it applies) an :class:`AdaptiveToCommunication` starting at
    ``target_global_batch``; otherwise a :class:`TargetGlobalBatch`. The last three
    arguments carry a resumed run's adaptive state.

    Example::

        >>> build_policy(8, 4, target_global_batch=256).accumulation(step=0)
        8
        >>> adaptive = build_policy(8, 2, max_global_batch=256, resumed_global_batch=64)
        >>> adaptive.accumulation(step=0), adaptive.reason
        (4, 'resumed at global batch 64')
    """
    if schedule is not None:
        return StepSchedule(schedule, micro_batch, world_size, unit)
    start = TargetGlobalBatch(target_global_batch, micro_batch, world_size)
    if max_global_batch is None:
        return start
    return AdaptiveToCommunication(
        start,
        max_global_batch,
        threshold,
        resumed_global_batch=resumed_global_batch,
        probed=probed,
        next_check=next_check,
    )


def first_global_batch(
    micro_batch: int,
    schedule: Mapping[int, int] | None = None,
    target_global_batch: int | None = None,
) -> int:
    """The global batch of a fit's first step: the schedule's key 0, else the target,
    else one micro-batch per step (``micro_batch`` on one rank).

    Example::

        >>> first_global_batch(8, schedule={0: 64, 100: 256}), first_global_batch(8)
        (64, 8)
    """
    if schedule is not None:
        start = [batch for key, batch in schedule.items() if key == 0]
        return start[0] if start else micro_batch
    return target_global_batch or micro_batch
