"""ProfilerSchedule: scheduled torch.profiler windows; a gzip trace and a report per window."""

from __future__ import annotations

import contextlib
import errno
import functools
import gzip
import math
import re
import shutil
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.profilers import PyTorchProfiler
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerAction, ProfilerActivity

from lightning_speedkit import _compat, _validation
from lightning_speedkit.compute.regional_compile import CompileWatch
from lightning_speedkit.measure.report import Report, amend_for_callbacks, analyze_trace

__all__ = ["ProfilerSchedule"]

#: Names of the regions ProfilerSchedule marks in every profiled step.
PHASES = ("data_fetch", "forward", "backward", "optimizer_step")
MARK = "speedkit/"


class _Region:
    """One ``record_function`` region opened in one hook and closed in another."""

    def __init__(self) -> None:
        self._open: dict[str, Any] = {}

    def enter(self, name: str) -> None:
        self.exit(name)
        region = record_function(MARK + name)
        region.__enter__()
        self._open[name] = region

    def exit(self, name: str) -> bool:
        """Close the region if it is open; whether it was."""
        region = self._open.pop(name, None)
        if region is None:
            return False
        region.__exit__(None, None, None)
        return True

    def exit_all(self) -> None:
        if self._open:
            for name in list(self._open):
                self.exit(name)


def _top_level(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules whose shares the report gives: the LightningModule's children, or, when
    it holds a single model (``self.model``), that model's children (``model.vision``...).

    Only children with parameters decide "single": metrics (torchmetrics are modules)
    and parameterless helpers beside ``self.model`` would otherwise stop the descent
    and leave the report one row, ``model``, at 100%.
    """
    prefix, children = "", list(module.named_children())
    while True:
        holding = [(name, child) for name, child in children if _has_parameters(child)]
        if len(holding) != 1 or not list(holding[0][1].children()):
            return [(prefix + name, child) for name, child in children]
        name, only = holding[0]
        prefix += name + "."
        children = list(only.named_children())


def _marked_modules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules ProfilerSchedule marks, each with its row in the report.

    The rows are :func:`_top_level`'s. A container among them (an ``nn.ModuleList`` of
    blocks, an ``nn.ModuleDict``: no forward of its own, so it is never called and its
    hooks never run) is marked through its called parts, the shallowest modules under it
    that have a forward (``blocks.0``, ``blocks.1``, ...), all under the container's name:
    nanoGPT's blocks are one row, ``blocks``, their forward times summed.
    """
    marked = []
    for name, child in _top_level(module):
        parts = _called_parts(child) if _is_container(child) else [child]
        marked += [(name, part) for part in parts]
    return marked


def _is_container(module: torch.nn.Module) -> bool:
    """A module without a forward of its own (``nn.ModuleList``, ``nn.ModuleDict``)."""
    return type(module).forward is torch.nn.Module.forward


def _called_parts(container: torch.nn.Module) -> list[torch.nn.Module]:
    """The shallowest modules under ``container`` that have a forward, in order."""
    parts = []
    for child in container.children():
        parts += _called_parts(child) if _is_container(child) else [child]
    return parts


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


def _has_parameters(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _why_not_written(directory: Path, error: BaseException | None, *, made: bool = True) -> str:
    """What a failed trace write means for the user: a vanished directory, a full disk.

    ``made``: whether the directory was made (at setup) and has changed since; before,
    the reason is what stands in the way of making it.
    """
    if directory.is_file():  # a file has its name
        if made:
            return f"the directory {directory} is now a file"
        return f"{directory} is a file, not a directory"
    if not directory.is_dir():
        if made:
            gone = "is no longer a directory" if directory.exists() else "no longer exists"
            return f"the directory {directory} {gone}"
        why = error.strerror if isinstance(error, OSError) and error.strerror else error
        return f"cannot make the directory {directory}: {why}"
    full = isinstance(error, OSError) and error.errno == errno.ENOSPC
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    if full or free == 0:
        left = "" if free is None else f", {free / 2**10:.0f} KiB free"
        return f"no space left on the device of {directory}{left}"
    if error is None:  # torch's profiler logs its own error and writes nothing
        return f"torch's profiler wrote no trace file in {directory} (its log above says why)"
    return f"{type(error).__name__}: {error}"


class ProfilerSchedule(L.Callback):
    """Profiles chosen training steps with torch.profiler; writes a trace per window.

    The schedule is torch's: skip ``skip_first`` steps, then ``repeat`` cycles (0:
    until training ends) of ``wait`` idle steps, ``warmup`` steps profiled and
    thrown away (the profiler's own start-up), and ``active`` steps recorded. Steps
    are training batches, counted from Lightning's hooks, so the schedule holds with
    accumulation, validation and resumes (Lightning's own PyTorchProfiler ignores
    ``repeat``). After each window, every rank writes
    ``<dirpath>/rank<R>-window<W>.pt.trace.json.gz``, a chrome trace (open it in
    Perfetto or chrome://tracing, or analyse it again with ``speedkit report``), and
    its diagnosis: ``.report`` (a :class:`~lightning_speedkit.measure.report.Report`:
    ``.breakdown`` of step time, ``.findings`` each with ``.kind``, ``.evidence`` and
    ``.fix``), written as ``speedkit_report.md``, ``.json`` and ``.png`` beside the
    traces (ranks other than 0 add ``-rank<R>``).

    Inside profiled steps it marks, with ``record_function``, the phases
    ``speedkit/data_fetch`` (between batches), ``speedkit/forward``,
    ``speedkit/backward``, ``speedkit/optimizer_step``, and the forward of each
    top-level child module of the LightningModule (``speedkit/module/<name>``, e.g.
    vision encoder, projector, language model; the blocks of an ``nn.ModuleList``, which
    has no forward of its own, under the list's name), so time can be attributed although
    Lightning runs forward and backward inside the optimizer's closure. Outside the
    windows nothing is marked and no torch profiler exists (it is made as a window's
    first step begins and dropped once its trace is written): a step costs the hooks a
    counter compare, a check per marked module, and a clock read (the un-profiled step
    time and data wait the report compares with; a step followed by validation or a
    checkpoint save is left out of them, as validation is left out of a window's report).

    Profiling never stops training: a directory that cannot be written or that
    disappears, a full disk (partial files are removed), a trace over ``max_trace_mb``
    (dropped before it is analysed) or a profiler error is said once (rank 0) and
    training goes on without it. torch has one profiling session per process, so with
    ``Trainer(profiler="pytorch")``, or inside a ``torch.profiler.profile`` block,
    ProfilerSchedule stands down with a warning that says which to keep. Traces are
    numbered on from the highest window already in the directory: a second ``fit``, or
    another run writing there, never overwrites earlier traces.

    Args:
        skip_first: steps before the first cycle. 0 by default, as in torch's
            ``schedule``, so that ``ProfilerSchedule(wait=1, warmup=1, active=3)`` records
            the steps torch's own schedule would (the third to the fifth); the first
            cycle's ``wait`` (5 by default) already leaves out the start-up steps. Raise
            it past compilation or tuning that lasts longer. A run that ends before its
            first window is complete says so, with the steps it ran and the steps the
            window needed.
        wait: idle steps at the start of each cycle.
        warmup: steps profiled but not kept, before each window.
        active: steps recorded per window (3 is plenty; each one adds to the trace).
        repeat: windows; 0 repeats until training ends.
        dirpath: where traces go; default ``<log dir>/profiler``.
        num_traces_to_keep: per rank, the newest traces of this fit kept; its older ones
            are deleted (traces of earlier runs in the directory are left alone).
        max_trace_mb: a compressed trace larger than this is deleted with a warning.
        record_shapes: record operator input shapes (bigger traces).
        with_stack: record Python stacks, which name the call sites of host syncs
            (bigger traces, a little slower).
        profile_memory: record allocations.

    Example::

        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[ProfilerSchedule(wait=5, active=3)],
        ...                     logger=False)
    """

    def __init__(
        self,
        skip_first: int = 0,
        wait: int = 5,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        dirpath: str | Path | None = None,
        *,
        num_traces_to_keep: int = 5,
        max_trace_mb: float = 200.0,
        record_shapes: bool = False,
        with_stack: bool = True,
        profile_memory: bool = False,
    ) -> None:
        for name, value, least in (("skip_first", skip_first, 0), ("wait", wait, 0),
                                   ("warmup", warmup, 0), ("active", active, 1),
                                   ("repeat", repeat, 0),
                                   ("num_traces_to_keep", num_traces_to_keep, 1)):  # fmt: skip
            _validation.integer(name, value, at_least=least)
        _validation.optional(_validation.path, "dirpath", dirpath)
        _validation.positive_number("max_trace_mb", max_trace_mb, example=200, hint="megabytes")
        for name, flag in (("record_shapes", record_shapes), ("with_stack", with_stack),
                           ("profile_memory", profile_memory)):  # fmt: skip
            _validation.boolean(name, flag)
        self.skip_first, self.wait, self.warmup = skip_first, wait, warmup
        self.active, self.repeat = active, repeat
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.num_traces_to_keep = num_traces_to_keep
        self.max_trace_mb = float(max_trace_mb)
        self.record_shapes = record_shapes
        self.with_stack = with_stack
        self.profile_memory = profile_memory
        self.traces: list[Path] = []
        """This rank's traces written in this fit, oldest first (pruned ones removed)."""
        self.report: Report | None = None
        """The latest window's diagnosis (:class:`~lightning_speedkit.measure.report.Report`)."""
        self.report_files: list[Path] = []
        """Its markdown, JSON and PNG (``speedkit_report.*``; other ranks add ``-rank<R>``)."""
        self._device = torch.device("cpu")
        self._callbacks: list[str] = []
        # Data fetch and step seconds of recent steps the profiler did not record.
        self._unprofiled: tuple[deque[float], deque[float]] = (deque(maxlen=50), deque(maxlen=50))
        self._batch_end: float | None = None
        self._batch_start: float | None = None
        self._profiler: Any = None
        self._activities: list[ProfilerActivity] = []
        self._directory = Path()
        self._regions = _Region()
        self._hooks: list[Any] = []
        # The first step of the next window (its warm-up): until then, no profiler exists.
        self._next_window: float = math.inf
        self._rank = 0
        self._windows = 0
        self._steps = 0
        self._resumed: tuple[int, int, int] | None = None
        self._warned: set[str] = set()
        self._failure: tuple[str, str] | None = None
        self._disabled = False
        self._start_step = 0
        self._written = 0
        # Steps the open window has recorded (not warmed up): a window that training ends
        # before its first recorded step is dropped, not written empty.
        self._window_recorded = 0
        # torch.compile: a window waits until the model has stopped compiling (see _schedule).
        self._compiles = CompileWatch()
        self._compiled_before_step = 0
        self._held = False
        self._delay = self._start_delay = 0
        self._base_schedule: Any = None
        # Puts the Trainer's own save_checkpoint back (see _time_saves).
        self._untime_saves: Callable[[], None] | None = None

    # -- failure handling: say it once, go on -------------------------------------------------

    def _give_up(self, what: str, why: str, *, stop: bool = True) -> None:
        """Say once why profiling ends, and end it. Never call from inside ``_write_trace``:
        that runs within torch's own ``profiler.step()``, and stopping the profiler there
        re-enters torch's state machine mid-transition (the process then segfaults)."""
        if what not in self._warned:
            self._warned.add(what)
            rank_zero_warn(f"ProfilerSchedule: {what} failed ({why}); training goes on without "
                           f"profiling.")  # fmt: skip
        self._stop_quietly(stop=stop)

    def _stop_quietly(self, *, stop: bool = True) -> None:
        self._regions.exit_all()
        profiler, self._profiler = self._profiler, None
        if profiler is not None and stop:
            with contextlib.suppress(Exception):  # already giving up on the profiler
                profiler.stop()  # a window cut short is written here, unless disabled
        self._disabled = True
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._compiles.remove()

    def _raise_pending(self) -> None:
        """Give up on a trace write that failed inside torch's ``step()``/``stop()``, now
        that it has returned."""
        if self._failure is not None:
            # Cleared only once the profiler is stopped: with wait=0 the failed step() has
            # begun the next window, and stop() would write it (see _write_trace).
            what, why = self._failure
            self._give_up(what, why)
            self._failure = None

    # -- set-up ----------------------------------------------------------------------------------

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._rank = trainer.global_rank
        self._device = trainer.strategy.root_device
        self._callbacks = [type(c).__name__ for c in trainer.callbacks]  # type: ignore[attr-defined]
        self.traces = []
        self.report, self.report_files = None, []
        self._batch_end = self._batch_start = None
        self._failure, self._disabled, self._written = None, False, 0
        self._window_recorded = 0
        self._warned.clear()  # a new fit says its own troubles
        for timings in self._unprofiled:
            timings.clear()
        # A resumed run goes on with its schedule: the windows it took are not taken again.
        self._steps, self._windows, self._delay = self._resumed or (0, 0, 0)
        self._start_delay = self._delay
        self._start_step = self._steps
        self._resumed = None
        self._held = _compat.has_compiled_parts(pl_module)
        self._base_schedule = torch.profiler.schedule(
            skip_first=self.skip_first, wait=self.wait, warmup=self.warmup,
            active=self.active, repeat=self.repeat)  # fmt: skip
        other = self._other_profiler(trainer)
        if other:
            # torch has one profiling session per process: two profilers share it, and
            # whichever stops first pulls it from under the other (a segfault, not an error).
            self._disabled = True
            who, advice = other
            rank_zero_warn(
                f"ProfilerSchedule stands down: {who} already runs torch.profiler, and two "
                f"profilers in one process crash it. Keep one: {advice}."
            )
            return
        root = trainer.log_dir or trainer.default_root_dir
        directory = self.dirpath or Path(root) / "profiler"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".write-test-rank{self._rank}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            why = _why_not_written(directory, error, made=False)
            self._give_up(f"writing to {directory}", why)
            return
        self._directory = directory
        self._activities = [ProfilerActivity.CPU]
        if trainer.strategy.root_device.type == "cuda":
            self._activities.append(ProfilerActivity.CUDA)
        self._compiles.install()
        self._compiled_before_step = self._compiles.compilations
        # For the whole fit: hooks added to a compiled module later would recompile it.
        for name, part in _marked_modules(pl_module):
            self._hooks.append(part.register_forward_pre_hook(self._module_enter(name)))
            self._hooks.append(part.register_forward_hook(self._module_exit(name)))
        rank_zero_info(f"ProfilerSchedule: traces go to {directory}")
        self._time_saves(trainer)
        self._next_window = self._window_after(self._steps)
        self._step_is_next()

    def _window_after(self, step: int) -> float:
        """The first step from ``step`` on that the schedule profiles (``math.inf``: none)."""
        position = _first_profiled(
            max(step - self._delay, 0), skip_first=self.skip_first, wait=self.wait,
            warmup=self.warmup, active=self.active, repeat=self.repeat)  # fmt: skip
        return position + self._delay

    def _step_is_next(self) -> None:
        """Step ``self._steps`` comes next: open a window that starts there.

        Compiling under the profiler records every operator the compiler runs on fake
        tensors (with Python stacks: tens of GB of events for a small model, and an
        out-of-memory kill), so while a model with compiled parts has not yet run a step
        without compiling, a window that is due is held back a step.
        """
        if self._steps < self._next_window:
            return
        if self._held:
            self._delay += 1
            self._next_window = self._window_after(self._steps)
            return
        try:
            profiler: Any = torch.profiler.profile(
                activities=self._activities,
                schedule=self._schedule,
                on_trace_ready=self._write_trace,
                record_shapes=self.record_shapes,
                with_stack=self.with_stack,
                profile_memory=self.profile_memory,
            )
            profiler.step_num = self._steps
            profiler.current_action = profiler.schedule(self._steps)
            profiler.start()
        except Exception as error:  # profiling must never stop training
            # A profiler that did not start owns no session: stopping it could end another's.
            self._give_up("starting the profiler", f"{type(error).__name__}: {error}", stop=False)
            return
        self._profiler = profiler
        self._window_recorded = 0
        self._compiled_before_step = self._compiles.compilations

    def _window_ended(self) -> None:
        """The window's trace is written (in ``step()``): drop the profiler until the next."""
        profiler, self._profiler = self._profiler, None
        try:
            profiler.stop()  # closes torch's ProfilerStep range; nothing left to write
        except Exception as error:  # profiling must never stop training
            self._give_up("stopping the profiler", f"{type(error).__name__}: {error}", stop=False)
            return
        self._next_window = self._window_after(self._steps)

    def _schedule(self, step: int) -> ProfilerAction:
        """torch's schedule, shifted by the steps a window waited for torch.compile."""
        position = step - self._delay
        if position < 0:
            return ProfilerAction.NONE
        action: ProfilerAction = self._base_schedule(position)
        return action

    @staticmethod
    def _other_profiler(trainer: L.Trainer) -> tuple[str, str] | None:
        """Who else runs torch.profiler in this process, if anyone, and how to keep one."""
        ours = ("(ProfilerSchedule writes traces and a report per window), or remove "
                "ProfilerSchedule from the callbacks (`speedkit report TRACE` reads {} traces "
                "too)")  # fmt: skip
        profiler = getattr(trainer, "profiler", None)
        if isinstance(profiler, PyTorchProfiler):
            who = "the Trainer's `profiler=` (Lightning's PyTorchProfiler)"
            return who, "remove `profiler=` from the Trainer " + ours.format("Lightning's")
        if _compat.torch_profiler_enabled():
            who = "a torch.profiler session opened around `fit()`"
            block = "remove your own `torch.profiler.profile()` block around `fit()` "
            return who, block + ours.format("torch's")
        return None

    def _recording(self) -> bool:
        profiler = self._profiler
        return profiler is not None and profiler.current_action != ProfilerAction.NONE

    def _module_enter(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if self._recording():
                self._regions.enter(f"module/{name}")

        return hook

    def _module_exit(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._profiler is not None:
                self._regions.exit(f"module/{name}")

        return hook

    # -- the step's phases -----------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._profiler is None:  # outside a window: only the step's time, for the report
            if self._batch_end is not None and self._batch_start is not None:
                self._unprofiled[0].append(now - self._batch_end)
                self._unprofiled[1].append(now - self._batch_start)
            self._batch_start = now
            return
        self._regions.exit("data_fetch")
        if self._recording():
            self._regions.enter("forward")
            self._batch_end = None  # a profiled step: its timings are the profiler's
        elif self._batch_end is not None and self._batch_start is not None:
            self._unprofiled[0].append(now - self._batch_end)
            self._unprofiled[1].append(now - self._batch_start)
        self._batch_start = now

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        if self._profiler is None:
            return
        self._regions.exit("forward")
        if self._recording():
            self._regions.enter("backward")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._profiler is not None:
            self._regions.exit("backward")

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        if self._profiler is None:
            return
        self._regions.exit("forward")  # a step without backward (skipped loss)
        if self._recording():
            self._regions.enter("optimizer_step")

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._profiler is None:  # outside a window: a counter compare
            if not self._disabled:
                self._batch_end = time.perf_counter()
                self._steps += 1
                if self._held:  # until a whole step runs compiled code without compiling
                    self._held = self._compiled_in_step() > 0
                self._step_is_next()
                if self._recording():  # a window opened here: its first fetch is marked too
                    self._regions.enter("data_fetch")
            return
        self._regions.exit_all()
        recording = self._recording()
        action = self._profiler.current_action
        if action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE):
            self._window_recorded += 1
        self._batch_end = None if recording else time.perf_counter()
        self._steps += 1
        compiled = self._compiled_in_step()
        if compiled and recording and "compile" not in self._warned:
            self._warned.add("compile")
            rank_zero_warn(
                f"ProfilerSchedule: torch.compile compiled {compiled} graph(s) during a "
                f"profiled step, so this window's trace and report describe the compiler as "
                f"much as the step. Raise `skip_first` past the steps that compile (shapes "
                f"that change recompile: pad or mark them dynamic)."
            )
        try:
            self._profiler.step()  # may end a window: _write_trace runs here
        except Exception as error:  # profiling must never stop training
            # "Profiler is already enabled": another profiler owns torch's session; stopping
            # ours would end theirs under them.
            self._give_up("profiling a step", f"{type(error).__name__}: {error}",
                          stop="already enabled" not in str(error))  # fmt: skip
            return
        if action == ProfilerAction.RECORD_AND_SAVE:
            # The window is written; with wait=0 the same profiler warms up the next one.
            self._window_recorded = 0
        self._raise_pending()
        if self._profiler is None:
            return
        if self._profiler.current_action == ProfilerAction.NONE:
            self._window_ended()
        elif self._recording():
            self._regions.enter("data_fetch")  # closed when the next batch arrives

    def _compiled_in_step(self) -> int:
        """Graphs torch.compile compiled since the last call (a step; a whole step that
        compiled nothing releases a held window)."""
        compiled = self._compiles.compilations - self._compiled_before_step
        self._compiled_before_step = self._compiles.compilations
        return compiled

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Validation is not data wait, in a window nor in the un-profiled timings: the gap it
        # runs in is not timed (nor is the fetch after it, which had validation's time to load).
        self._batch_end = None
        self._regions.exit("data_fetch")
        if self._recording():  # inside a window: not a training step's time (the report)
            self._regions.enter("validation")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._regions.exit("validation")

    # -- checkpoint saves ------------------------------------------------------------------------

    def _time_saves(self, trainer: L.Trainer) -> None:
        """Mark every checkpoint save of this fit, from its start to its end.

        Lightning has a hook where a save begins (``on_save_checkpoint``, partway through
        collecting the state) and none where it ends, so for the fit the Trainer's
        ``save_checkpoint``, which checkpoint callbacks call, is wrapped; ``on_train_end``
        and ``on_exception`` put it back.
        """
        self._restore_saves()
        save = trainer.save_checkpoint
        previous = vars(trainer).get("save_checkpoint")  # an override of the user's, if any

        @functools.wraps(save)
        def timed(*args: Any, **kwargs: Any) -> Any:
            fetching = self._save_begins()
            try:
                return save(*args, **kwargs)
            finally:
                self._save_ends(fetching)

        def untime() -> None:
            if vars(trainer).get("save_checkpoint") is timed:  # not wrapped again since
                if previous is None:
                    del vars(trainer)["save_checkpoint"]
                else:
                    vars(trainer)["save_checkpoint"] = previous

        vars(trainer)["save_checkpoint"] = timed
        self._untime_saves = untime

    def _restore_saves(self) -> None:
        untime, self._untime_saves = self._untime_saves, None
        if untime is not None:
            untime()

    def _save_begins(self) -> bool:
        """A save is not data wait, in a window nor in the un-profiled timings. Whether it
        interrupted a marked fetch: ModelCheckpoint saves after this callback's batch end
        has opened the next one."""
        self._batch_end = None  # this gap is not timed
        if not self._recording():
            return False
        fetching = self._regions.exit("data_fetch")
        self._regions.enter("checkpoint")
        return fetching

    def _save_ends(self, fetching: bool) -> None:
        self._regions.exit("checkpoint")
        if fetching and self._recording():
            self._regions.enter("data_fetch")  # the next batch is still to come

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # A checkpoint loaded by validate() or test() is not a run to resume: only fit's
        # restore, which on_train_start takes, is.
        self._resumed = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_saves()
        running = not self._disabled
        self._end_window()
        if self._failure is not None:
            self._raise_pending()
        elif running and not self._written:
            self._say_nothing_recorded()

    def _say_nothing_recorded(self) -> None:
        """A run that ended before its first window: say so, with the arithmetic."""
        taken = self._windows
        if self.repeat and taken >= self.repeat:
            return  # a resumed run whose windows were all taken before
        ran = self._steps - self._start_step
        # Positions in torch's schedule; the steps held for torch.compile come on top.
        # torch saves a window at the last step of a cycle (wait + warmup + active
        # steps) after skip_first: arithmetic, not a walk (skip_first may be 10**9).
        start = self._start_step - self._start_delay
        cycle = self.wait + self.warmup + self.active
        cycles_done = max(start - self.skip_first, 0) // cycle
        saved_at = self.skip_first + cycles_done * cycle + cycle - 1
        held = self._delay - self._start_delay
        needed = saved_at + 1 - start + held
        if self._start_step == 0:
            arithmetic = (f"skip_first + wait + warmup + active = {self.skip_first} + "
                          f"{self.wait} + {self.warmup} + {self.active}"
                          + (f" + {held} held while torch.compile compiled"
                             if held else "") + f" = {needed}")  # fmt: skip
        else:
            arithmetic = f"{needed} more, resuming at step {self._start_step}"
        rank_zero_warn(
            f"ProfilerSchedule recorded nothing: training ran {ran} steps, and its first "
            f"window needed {arithmetic} steps. Lower `skip_first` or `wait`, or train longer."
        )

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._restore_saves()
        if self._recording():  # the step the exception ended is no step: say so in the trace
            self._regions.exit_all()
            self._regions.enter("aborted")
            self._regions.exit("aborted")
        self._end_window()

    def _end_window(self) -> None:
        """Training ends (or fails) with a window open: write it as it stands, unless it
        recorded no step (training ended in its warm-up); a resumed run takes it whole."""
        if self._profiler is not None and not self._window_recorded:
            self._disabled = True  # _write_trace, called by stop(), writes nothing
        self._stop_quietly()

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self._steps, "windows": self._windows, "delay": self._delay}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = (int(state_dict["steps"]), int(state_dict["windows"]),
                         int(state_dict.get("delay", 0)))  # fmt: skip

    # -- traces and reports -----------------------------------------------------------------------

    def _analyse(self, raw: Path, path: Path) -> None:
        """The window's report, next to the traces; a failure here costs only the report."""
        try:
            memory = None
            if self._device.type == "cuda":
                capacity = torch.cuda.get_device_properties(self._device).total_memory
                memory = (float(torch.cuda.max_memory_reserved(self._device)), float(capacity))
            # Medians: the first steps of a fit (allocations, lazy set-up) are not typical.
            fetches, steps = self._unprofiled
            share = step_ms = None
            if steps and statistics.median(steps) > 0:
                share = min(statistics.median(fetches) / statistics.median(steps), 1.0)
                step_ms = 1e3 * statistics.median(steps)
            report = analyze_trace(
                raw,
                memory=memory,
                source=path.name,
                unprofiled_data_share=share,
                unprofiled_step_ms=step_ms,
            )
            amend_for_callbacks(report, self._callbacks)
            stem = "speedkit_report" if self._rank == 0 else f"speedkit_report-rank{self._rank}"
            self.report_files = report.write(self._directory, stem)
        except Exception as error:
            if "report" not in self._warned:
                self._warned.add("report")
                rank_zero_warn(
                    f"ProfilerSchedule: the report of {path.name} failed ({type(error).__name__}:"
                    f" {error}); traces are still written."
                )
            return
        self.report = report
        if self._rank == 0:
            kinds = ", ".join(report.kinds) or "nothing stands out"
            rank_zero_info(f"ProfilerSchedule: {kinds}; report in {self.report_files[0]}")

    def _next_window_path(self) -> Path:
        """A name no earlier window in the directory has: a second ``fit`` with the same
        callback, or another run logging to the same directory, keeps the earlier traces."""
        pattern = re.compile(rf"rank{self._rank}-window(\d+)\.pt\.trace\.json\.gz$")
        taken = [int(m.group(1)) for p in self._directory.iterdir() if (m := pattern.match(p.name))]
        index = max(taken, default=-1) + 1
        return self._directory / f"rank{self._rank}-window{index}.pt.trace.json.gz"

    def _write_trace(self, profiler: Any) -> None:
        # Runs inside torch's profiler.step() or stop(): a failure is recorded for the hook
        # that called them (see _give_up), never acted on here.
        if self._disabled or self._failure is not None:
            return
        self._windows += 1
        try:
            path = self._next_window_path()
        except OSError as error:
            self._failure = ("writing a trace", _why_not_written(self._directory, error))
            return
        raw = path.with_suffix("")  # .pt.trace.json; torch writes <raw>.tmp, then renames it
        partial = (raw, raw.with_name(raw.name + ".tmp"), path)
        try:
            profiler.export_chrome_trace(str(raw))
            if not raw.is_file():  # torch logged its own error and wrote nothing usable
                raise _NotWrittenError
            with raw.open("rb") as source, gzip.open(path, "wb", compresslevel=6) as target:
                shutil.copyfileobj(source, target)
            size_mb = path.stat().st_size / 2**20
        except Exception as error:  # a full disk must not stop training, nor stay full
            cause = None if isinstance(error, _NotWrittenError) else error
            why = _why_not_written(self._directory, cause)
            for leftover in partial:
                with contextlib.suppress(OSError):
                    leftover.unlink(missing_ok=True)
            self._failure = (f"writing the trace {path.name}", why)
            return
        try:
            # The cap first: analysing a trace takes about 13 bytes of memory per byte.
            if size_mb > self.max_trace_mb:
                path.unlink()
                if "cap" not in self._warned:
                    self._warned.add("cap")
                    rank_zero_warn(
                        f"ProfilerSchedule: a trace of {size_mb:.1f} MB is over max_trace_mb="
                        f"{self.max_trace_mb:g} and was neither kept nor analysed. Profile "
                        f"fewer steps (active={self.active}), or drop with_stack / "
                        f"record_shapes / profile_memory."
                    )
                return
            self._written += 1
            self._analyse(raw, path)
        finally:
            with contextlib.suppress(OSError):
                raw.unlink(missing_ok=True)
        self.traces.append(path)
        while len(self.traces) > self.num_traces_to_keep:
            with contextlib.suppress(OSError):
                self.traces.pop(0).unlink(missing_ok=True)


class _NotWrittenError(Exception):
    """torch's profiler returned without writing the trace file."""
