"""ProfilerSchedule's windows: a torch profiler made as each one starts, dropped once written.

:class:`WindowRunner` counts training steps and, at the steps :class:`ProfilerCycle`
names, makes a ``torch.profiler.profile`` driven by that cycle; the profiler writes the
window's trace through a :class:`TraceStore` and is dropped until the next window.
Outside the windows no profiler exists, and a step costs a counter compare.

Profiling never stops training: a failure is said once (rank 0) and profiling ends
for the fit. A failure inside torch's own ``step()``/``stop()`` (which run the trace
write) is only recorded there and acted on once they have returned (see
:meth:`WindowRunner.give_up`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.profiler import ProfilerAction, ProfilerActivity

from lightning_speedkit.measure._profiler_cycle import ProfilerCycle
from lightning_speedkit.measure._profiler_hold import CompileHold
from lightning_speedkit.measure._profiler_marks import StepMarks
from lightning_speedkit.measure._profiler_traces import TraceNotWrittenError, TraceStore

__all__ = ["ProfilerOptions", "WindowRunner", "window_open"]

_RECORDED = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)

#: Every WindowRunner of the process (torch has one profiling session per process).
_RUNNERS: weakref.WeakSet[WindowRunner] = weakref.WeakSet()


def window_open() -> bool:
    """Whether a ProfilerSchedule window's profiler exists in this process: from the end of
    the step before the window's first (warm-up) step until its trace is written. Those
    steps run slower than training does, and the trace's writing and analysis (seconds)
    runs in a batch-end hook: SpeedMonitor leaves both out of its timings. A walk of the
    runners (one per ProfilerSchedule), no more."""
    return any(runner.profiler is not None for runner in list(_RUNNERS))


class ProfilerOptions(TypedDict):
    """What each window's ``torch.profiler.profile`` records beyond its operators."""

    record_shapes: bool
    with_stack: bool
    profile_memory: bool


def _no_analysis(raw: Path, path: Path) -> None:
    """No trace analysed yet (a module function: ``ddp_spawn`` pickles the callbacks)."""


class WindowRunner:
    """The profiler's life over one fit: when it exists, what it writes, how it gives up.

    Args:
        cycle: which steps are profiled.
        marks: the step's marked regions, closed (and their module hooks removed) when
            profiling ends.
        hold: whether a due window waits for torch.compile.
        options: passed to ``torch.profiler.profile`` (none recorded by default).

    Example::

        >>> import tempfile
        >>> from pathlib import Path
        >>> runner = WindowRunner(ProfilerCycle(skip_first=1, wait=0, warmup=0, active=1,
        ...                                     repeat=1), marks=StepMarks())
        >>> runner.reset(None)
        >>> store = TraceStore(Path(tempfile.mkdtemp()), rank=0, max_trace_mb=100, keep=1)
        >>> runner.start(store, analyse=lambda raw, path: None, compiled_parts=False)
        >>> for _ in range(3):
        ...     _ = runner.step_ends()
        >>> [p.name for p in store.traces], runner.windows
        (['rank0-window0.pt.trace.json.gz'], 1)
    """

    def __init__(
        self,
        cycle: ProfilerCycle,
        *,
        marks: StepMarks,
        hold: CompileHold | None = None,
        options: ProfilerOptions | None = None,
    ) -> None:
        self.cycle, self.marks = cycle, marks
        self.hold = hold if hold is not None else CompileHold()
        self._options = options or ProfilerOptions(
            record_shapes=False, with_stack=False, profile_memory=False
        )
        self.profiler: Any = None
        """The window's torch profiler; ``None`` between windows."""
        self.steps = self.windows = self.delay = 0
        """Steps trained, windows taken, steps held for torch.compile (the checkpoint's)."""
        self.disabled = False
        """Profiling is over for this fit (given up, stood down, or training ended)."""
        self.written = 0
        """Windows of this fit whose trace was kept."""
        self.failure: tuple[str, str] | None = None
        self._activities: list[ProfilerActivity] = []
        self._store: TraceStore | None = None
        self._analyse: Callable[[Path, Path], None] = _no_analysis
        # The first step of the next window (its warm-up): until then, no profiler exists.
        self._next_window: float = float("inf")
        self._start_step = self._start_delay = self._start_windows = 0
        # Steps the open window has recorded (not warmed up): a window that training ends
        # before its first recorded step is dropped, not written empty.
        self._window_recorded = 0
        self._warned: set[str] = set()
        _RUNNERS.add(self)

    # -- a fit's start and end -------------------------------------------------------------

    def reset(self, resumed: tuple[int, int, int] | None) -> None:
        """A fit begins; ``resumed``: the checkpoint's ``(steps, windows, delay)`` (a
        resumed run goes on with its schedule: the windows it took are not taken again)."""
        self.steps, self.windows, self.delay = resumed or (0, 0, 0)
        self._start_step, self._start_delay = self.steps, self.delay
        self._start_windows = self.windows
        self.failure, self.disabled, self.written = None, False, 0
        self._window_recorded = 0
        self._warned.clear()  # a new fit says its own troubles

    def start(
        self,
        store: TraceStore,
        *,
        analyse: Callable[[Path, Path], None],
        compiled_parts: bool,
        activities: tuple[ProfilerActivity, ...] = (ProfilerActivity.CPU,),
    ) -> None:
        """Profile this fit's windows into ``store``; ``analyse(raw, path)`` reads each
        trace before its JSON is removed. ``compiled_parts``: hold windows for compilation."""
        self._store, self._analyse, self._activities = store, analyse, list(activities)
        self.hold.begin(compiled_parts=compiled_parts)
        self._next_window = self.cycle.next_window(self.steps, self.delay)
        self._step_is_next()

    def finish(self) -> None:
        """Training ended: write an open window, say a pending failure, or say why nothing
        was recorded."""
        running = not self.disabled
        self.end_window()
        if self.failure is not None:
            self._raise_pending()
        elif running and self.windows == self._start_windows and not self._all_taken():
            rank_zero_warn(self.cycle.nothing_recorded(
                ran=self.steps - self._start_step, start_step=self._start_step,
                held=self.delay - self._start_delay, start_delay=self._start_delay))  # fmt: skip

    def _all_taken(self) -> bool:
        """A resumed run whose schedule's windows were all taken by the runs before it:
        none is left for it to record, and it says nothing. (One whose windows all fall
        before the resume point though the runs before took fewer, because its schedule
        changed, is told so by ``nothing_recorded``.)"""
        repeat = self.cycle.repeat
        behind = self.cycle.next_window(self._start_step, self._start_delay) == float("inf")
        return bool(repeat) and self._start_windows >= repeat and behind

    def end_window(self) -> None:
        """Training ends (or fails) with a window open: write it as it stands, unless it
        recorded no step (training ended in its warm-up); a resumed run takes it whole."""
        if self.profiler is not None and not self._window_recorded:
            self.disabled = True  # _write_trace, called by stop(), writes nothing
        self._stop_quietly()

    # -- steps -----------------------------------------------------------------------------

    def recording(self) -> bool:
        """Whether the profiler records the current step (not idle, not warming up)."""
        profiler = self.profiler
        return profiler is not None and profiler.current_action != ProfilerAction.NONE

    def step_ends(self) -> bool:
        """A training step ended; whether the next one is recorded (its fetch is marked)."""
        if self.profiler is None:  # outside a window: a counter compare
            if self.disabled:
                return False
            self.steps += 1
            self.hold.step_ends()  # until a whole step runs compiled code without compiling
            self._step_is_next()
            return self.recording()
        recording, action = self.recording(), self.profiler.current_action
        if action in _RECORDED:
            self._window_recorded += 1
        self.steps += 1
        compiled = self.hold.compiled_in_step()
        if compiled and recording:
            self.warn_once("compile", (
                f"ProfilerSchedule: torch.compile compiled {compiled} graph(s) during a "
                f"profiled step, so this window's trace and report describe the compiler as "
                f"much as the step. Raise `skip_first` past the steps that compile (shapes "
                f"that change recompile: pad or mark them dynamic)."))  # fmt: skip
        try:
            self.profiler.step()  # may end a window: _write_trace runs here
        except Exception as error:  # profiling must never stop training
            # "Profiler is already enabled": another profiler owns torch's session; stopping
            # ours would end theirs under them.
            self.give_up("profiling a step", f"{type(error).__name__}: {error}",
                         stop="already enabled" not in str(error))  # fmt: skip
            return False
        if action == ProfilerAction.RECORD_AND_SAVE:
            # The window is written; with wait=0 the same profiler warms up the next one.
            self._window_recorded = 0
        self._raise_pending()
        if self.profiler is None:
            return False
        if self.profiler.current_action == ProfilerAction.NONE:
            self._window_ended()
            return False
        return self.recording()

    def _step_is_next(self) -> None:
        """Step ``self.steps`` comes next: open a window that starts there, unless it is
        held for torch.compile (the whole schedule then moves a step later)."""
        if self.steps < self._next_window:
            return
        if self.hold.held:
            self.delay += 1
            self._next_window = self.cycle.next_window(self.steps, self.delay)
            return
        try:
            profiler: Any = torch.profiler.profile(
                activities=self._activities,
                schedule=self._action,
                on_trace_ready=self._write_trace,
                **self._options,
            )
            profiler.step_num = self.steps
            profiler.current_action = profiler.schedule(self.steps)
            profiler.start()
        except Exception as error:  # profiling must never stop training
            # A profiler that did not start owns no session: stopping it could end another's.
            self.give_up("starting the profiler", f"{type(error).__name__}: {error}", stop=False)
            return
        self.profiler = profiler
        self._window_recorded = 0
        self.hold.window_begins()

    def _action(self, step: int) -> ProfilerAction:
        """The window's schedule: the cycle, shifted by the steps held for torch.compile."""
        return self.cycle.action(step, self.delay)

    def _window_ended(self) -> None:
        """The window's trace is written (in ``step()``): drop the profiler until the next."""
        profiler, self.profiler = self.profiler, None
        try:
            profiler.stop()  # closes torch's ProfilerStep range; nothing left to write
        except Exception as error:  # profiling must never stop training
            self.give_up("stopping the profiler", f"{type(error).__name__}: {error}", stop=False)
            return
        self._next_window = self.cycle.next_window(self.steps, self.delay)

    def _write_trace(self, profiler: Any) -> None:
        """torch's ``on_trace_ready``. It runs inside torch's ``step()`` or ``stop()``: a
        failure is recorded for the caller (see :meth:`give_up`), never acted on here."""
        if self.disabled or self.failure is not None or self._store is None:
            return
        self.windows += 1
        try:
            saved = self._store.save(profiler.export_chrome_trace, self._analyse_kept)
        except TraceNotWrittenError as failure:
            self.failure = (failure.what, failure.why)
            return
        if not saved.kept:
            self.warn_once("cap", (
                f"ProfilerSchedule: a trace of {saved.size_mb:.3g} MB is over max_trace_mb="
                f"{self._store.max_trace_mb:g} and was neither kept nor analysed. Profile "
                f"fewer steps (active={self.cycle.active}), or drop with_stack / "
                f"record_shapes / profile_memory."))  # fmt: skip

    def _analyse_kept(self, raw: Path, path: Path) -> None:
        self.written += 1
        self._analyse(raw, path)

    # -- failures: say it once, go on ------------------------------------------------------

    def warn_once(self, key: str, message: str) -> None:
        """Warn (rank 0) with ``message`` unless a warning of this ``key`` was given this fit."""
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    def give_up(self, what: str, why: str, *, stop: bool = True) -> None:
        """Say once why profiling ends, and end it. Never call from inside ``_write_trace``:
        that runs within torch's own ``profiler.step()``, and stopping the profiler there
        re-enters torch's state machine mid-transition (the process then segfaults)."""
        self.warn_once(what, f"ProfilerSchedule: {what} failed ({why}); training goes on "
                             f"without profiling.")  # fmt: skip
        self._stop_quietly(stop=stop)

    def _stop_quietly(self, *, stop: bool = True) -> None:
        self.marks.close_all()
        profiler, self.profiler = self.profiler, None
        if profiler is not None and stop:
            with contextlib.suppress(Exception):  # already giving up on the profiler
                profiler.stop()  # a window cut short is written here, unless disabled
        self.disabled = True
        self.marks.unhook_modules()
        self.hold.end()

    def _raise_pending(self) -> None:
        """Give up on a trace write that failed inside torch's ``step()``/``stop()``, now
        that it has returned."""
        if self.failure is not None:
            # Cleared only once the profiler is stopped: with wait=0 the failed step() has
            # begun the next window, and stop() would write it (see _write_trace).
            what, why = self.failure
            self.give_up(what, why)
            self.failure = None
