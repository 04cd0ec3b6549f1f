"""When ProfilerSchedule profiles: torch's schedule as a pure function of the step.

torch's own ``torch.profiler.schedule`` decides each step's action. What it lacks, and
this module adds, as arithmetic on the step number:

- a shift: the steps a window waited while torch.compile was compiling (``delay``) push
  the whole schedule later;
- the next window: the first step from a given one at which a profiler must exist (no
  walk: ``skip_first`` may be 10**9);
- how many steps the first window needed, for a run that ended before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerAction

from lightning_speedkit import _validation

__all__ = ["ProfilerCycle"]


def _first_profiled(
    position: int, *, skip_first: int, wait: int, warmup: int, active: int, repeat: int
) -> float:
    """The first position from ``position`` on at which ``torch.profiler.schedule`` with
    these arguments returns an action other than NONE (a warm-up or a recorded step);
    ``math.inf`` when its ``repeat`` windows are all behind. Arithmetic, not a walk: the
    idle steps before a window cost a comparison each (``skip_first`` may be 10**9)."""
    cycle = wait + warmup + active
    into = max(position, skip_first) - skip_first
    done, within = divmod(into, cycle)
    if within < wait:
        into = done * cycle + wait
    if repeat and into >= repeat * cycle:
        return math.inf
    return skip_first + into


@dataclass(frozen=True)
class ProfilerCycle:
    """torch's profiler schedule, shifted by the steps a window was held back.

    Its arguments are checked as ProfilerSchedule's are (a ``SpeedkitConfigError`` names
    the one that is wrong). Each method is a pure function of its arguments: ``step``
    counts training batches from the start of training, ``delay`` the steps held for
    torch.compile so far.

    Args:
        skip_first: steps before the first cycle.
        wait: idle steps at the start of each cycle.
        warmup: steps profiled but not kept, before each window.
        active: steps recorded per window.
        repeat: windows; 0 repeats until training ends.

    Example::

        >>> cycle = ProfilerCycle(skip_first=0, wait=1, warmup=1, active=2, repeat=1)
        >>> [cycle.action(step).name for step in range(5)]
        ['NONE', 'WARMUP', 'RECORD', 'RECORD_AND_SAVE', 'NONE']
        >>> cycle.next_window(0), cycle.next_window(0, delay=2), cycle.next_window(4)
        (1, 3, inf)
    """

    skip_first: int
    wait: int
    warmup: int
    active: int
    repeat: int
    _torch: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, least in (("skip_first", 0), ("wait", 0), ("warmup", 0), ("active", 1),
                            ("repeat", 0)):  # fmt: skip
            _validation.integer(name, getattr(self, name), at_least=least)
        schedule = torch.profiler.schedule(
            skip_first=self.skip_first, wait=self.wait, warmup=self.warmup,
            active=self.active, repeat=self.repeat)  # fmt: skip
        object.__setattr__(self, "_torch", schedule)

    @property
    def length(self) -> int:
        """Steps in one cycle: ``wait + warmup + active``."""
        return self.wait + self.warmup + self.active

    def action(self, step: int, delay: int = 0) -> ProfilerAction:
        """torch's action for ``step``, with the schedule shifted ``delay`` steps later."""
        position = step - delay
        if position < 0:
            return ProfilerAction.NONE
        action: ProfilerAction = self._torch(position)
        return action

    def next_window(self, step: int, delay: int = 0) -> float:
        """The first step from ``step`` on that is profiled (``math.inf``: none is)."""
        position = _first_profiled(
            max(step - delay, 0), skip_first=self.skip_first, wait=self.wait,
            warmup=self.warmup, active=self.active, repeat=self.repeat)  # fmt: skip
        return position + delay

    def steps_to_save(self, start: int) -> int:
        """From position ``start`` (a step less the delay), the steps until the end of the
        window torch saves next (the last step of a cycle after ``skip_first``)."""
        cycles_done = max(start - self.skip_first, 0) // self.length
        saved_at = self.skip_first + cycles_done * self.length + self.length - 1
        return saved_at + 1 - start

    def nothing_recorded(self, *, ran: int, start_step: int, held: int, start_delay: int) -> str:
        """Why a run that trained ``ran`` steps from ``start_step`` (0, or where it resumed)
        recorded nothing: the steps its first window needed, ``held`` of them waiting for
        torch.compile; ``start_delay`` is the delay the run started with."""
        needed = self.steps_to_save(start_step - start_delay) + held
        if start_step == 0:
            arithmetic = (f"skip_first + wait + warmup + active = {self.skip_first} + "
                          f"{self.wait} + {self.warmup} + {self.active}"
                          + (f" + {held} held while torch.compile compiled"
                             if held else "") + f" = {needed}")  # fmt: skip
        else:
            arithmetic = f"{needed} more, resuming at step {start_step}"
        return (
            f"ProfilerSchedule recorded nothing: training ran {ran} steps, and its first "
            f"window needed {arithmetic} steps. Lower `skip_first` or `wait`, or train longer."
        )
