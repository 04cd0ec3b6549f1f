"""When ProfilerSchedule profiles: torch's schedule as a pure function of the step.

torch's own ``torch.profiler.schedule`` decides each step's action. What it lacks, and
this module adds, as arithmetic on the step number:

- a shift: the steps a window waited while torch.compile was compiling (``delay``) push
  the whole schedule later;
- the next window: the first step from a given one at which a profiler must exist (no
  walk: ``skip_first`` may be 10**9);
- why a run recorded nothing, in batches: the first window's arithmetic, the batches
  a resumed run's next window needed, or its windows all behind the resume point.
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

    def __reduce__(self) -> tuple[type[ProfilerCycle], tuple[int, ...]]:
        """A copy is made from the five numbers (``ddp_spawn`` pickles the callbacks, and
        torch's schedule is a closure)."""
        return ProfilerCycle, (self.skip_first, self.wait, self.warmup, self.active, self.repeat)

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
        """Why a run that trained ``ran`` batches from ``start_step`` (0, or the batches
        trained before it resumed) recorded nothing, in batches, and what would help:

        - a new run ended before its first window: the arithmetic of that window;
        - a resumed run ended before its next window: the batches that window needed
          from the resume point;
        - a resumed run whose windows all fall before the resume point (its schedule
          changed, or its windows were lost): where they end, and the settings that put
          a window after the resume point.

        ``held``: batches this run's window waited for torch.compile; ``start_delay``:
        those held before the run (they shift the schedule later).

        Example::

            >>> cycle = ProfilerCycle(skip_first=0, wait=1, warmup=1, active=1, repeat=3)
            >>> print(cycle.nothing_recorded(ran=12, start_step=24, held=0, start_delay=0))
            ProfilerSchedule recorded nothing: this run resumed after 24 batches and trained 12 more, but the schedule's 3 windows (`repeat=3`) all fall in the first skip_first + repeat x (wait + warmup + active) = 0 + 3 x (1 + 1 + 1) = 9 batches: a resumed run counts batches from the start of training. Set `repeat=0` (a window every cycle until training ends) or `repeat=9` or more, or `skip_first=24` to begin the cycles where this run resumed.
        """  # noqa: E501
        position = start_step - start_delay  # where the run starts, in the schedule's terms
        if start_step and math.isinf(self.next_window(start_step, start_delay)):
            return self._windows_behind(ran=ran, start_step=start_step, position=position,
                                        start_delay=start_delay)  # fmt: skip
        needed = self.steps_to_save(position) + held
        compiled = f" + {held} held while torch.compile compiled" if held else ""
        if start_step == 0:
            return (
                f"ProfilerSchedule recorded nothing: training ran {ran} batches, and its first "
                f"window needed skip_first + wait + warmup + active = {self.skip_first} + "
                f"{self.wait} + {self.warmup} + {self.active}{compiled} = {needed} batches. "
                f"Lower `skip_first` or `wait`, or train longer."
            )
        arithmetic = f" ({needed - held}{compiled})" if held else ""
        return (
            f"ProfilerSchedule recorded nothing: this run resumed after {start_step} batches "
            f"and trained {ran} more, and its next window needed {needed}{arithmetic} from "
            f"there. Train at least {needed} batches after resuming, or lower `skip_first` "
            f"or `wait` (a resumed run counts batches from the start of training)."
        )

    def _windows_behind(self, *, ran: int, start_step: int, position: int,
                        start_delay: int) -> str:  # fmt: skip
        """``nothing_recorded`` for a resumed run whose ``repeat`` windows all end before
        ``position``, the resume point in the schedule's terms (less the held batches)."""
        held = f" + {start_delay} held while torch.compile compiled" if start_delay else ""
        end = self.skip_first + self.repeat * self.length + start_delay
        # The first cycle whose window (warm-up included) begins after the resume point,
        # and the batches after resuming that its save and a cycle from there need.
        first = max(0, -(-(position - self.skip_first - self.wait) // self.length))
        needed = min(self.skip_first + (first + 1) * self.length, position + self.length)
        longer = (f", and train at least {needed - position} batches after resuming"
                  if ran < needed - position else "")  # fmt: skip
        return (
            f"ProfilerSchedule recorded nothing: this run resumed after {start_step} batches "
            f"and trained {ran} more, but the schedule's {self.repeat} windows (`repeat="
            f"{self.repeat}`) all fall in the first skip_first + repeat x (wait + warmup + "
            f"active) = {self.skip_first} + {self.repeat} x "
            f"({self.wait} + {self.warmup} + {self.active}){held} = {end} batches: a resumed "
            f"run counts batches from the start of training. Set `repeat=0` (a window every "
            f"cycle until training ends) or `repeat={first + 1}` or more, or `skip_first="
            f"{position}` to begin the cycles where this run resumed{longer}."
        )
