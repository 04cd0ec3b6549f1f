"""ProfilerSchedule: scheduled torch.profiler windows; a gzip trace and a report per window.

The callback only decides when; each idea it applies lives in its own module:

- ``_profiler_cycle``: which steps are profiled (torch's schedule, shifted, as arithmetic);
- ``_profiler_windows``: the profiler made per window, its trace written, failures said once;
- ``_profiler_hold``: a window held back while torch.compile compiles;
- ``_profiler_marks``: the marked phases, pauses and modules of a profiled step;
- ``_profiler_traces``: trace names, writing, the size cap, pruning;
- ``_profiler_timings``: the un-profiled step time and data wait the report compares with;
- ``_profiler_report``: a window's report; ``_profiler_rivals``: standing down beside
  another profiler.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.profiler import ProfilerActivity

from lightning_speedkit import _compat, _validation
from lightning_speedkit.measure._profiler_cycle import ProfilerCycle
from lightning_speedkit.measure._profiler_marks import StepMarks, TimedSaves
from lightning_speedkit.measure._profiler_report import analyse_window
from lightning_speedkit.measure._profiler_rivals import other_profiler, stand_down_message
from lightning_speedkit.measure._profiler_timings import UnprofiledTimings
from lightning_speedkit.measure._profiler_traces import TraceNotWrittenError, TraceStore
from lightning_speedkit.measure._profiler_windows import ProfilerOptions, WindowRunner
from lightning_speedkit.measure.report import Report, analyze_trace

__all__ = ["ProfilerSchedule"]


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
        cycle = ProfilerCycle(skip_first, wait, warmup, active, repeat)  # checks them
        _validation.integer("num_traces_to_keep", num_traces_to_keep, at_least=1)
        dirpath = _trace_folder(dirpath)
        _validation.positive_number("max_trace_mb", max_trace_mb, example=200, hint="megabytes")
        options = ProfilerOptions(record_shapes=record_shapes, with_stack=with_stack,
                                  profile_memory=profile_memory)  # fmt: skip
        for name, flag in options.items():
            _validation.boolean(name, flag)
        self.skip_first, self.wait, self.warmup = skip_first, wait, warmup
        self.active, self.repeat = active, repeat
        self.dirpath = dirpath
        self.num_traces_to_keep, self.max_trace_mb = num_traces_to_keep, float(max_trace_mb)
        self.record_shapes, self.with_stack = record_shapes, with_stack
        self.profile_memory = profile_memory
        self.traces: list[Path] = []
        """This rank's traces written in this fit, oldest first (pruned ones removed)."""
        self.report: Report | None = None
        """The latest window's diagnosis (:class:`~lightning_speedkit.measure.report.Report`)."""
        self.report_files: list[Path] = []
        """Its markdown, JSON and PNG (``speedkit_report.*``; other ranks add ``-rank<R>``)."""
        self._device, self._rank = torch.device("cpu"), 0
        self._callbacks: list[str] = []
        self._timings = UnprofiledTimings()
        self._unprofiled = self._timings.samples  # data fetch and step seconds
        self._marks = StepMarks()
        self._run = WindowRunner(cycle, marks=self._marks, options=options)
        self._resumed: tuple[int, int, int] | None = None
        self._saves = TimedSaves()

    # The steps trained, and the window's torch profiler (None between windows).
    _steps = property(lambda self: self._run.steps)
    _profiler = property(lambda self: self._run.profiler)
    _other_profiler = staticmethod(other_profiler)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._rank, self._device = trainer.global_rank, trainer.strategy.root_device
        self._callbacks = [type(c).__name__ for c in trainer.callbacks]  # type: ignore[attr-defined]
        self.traces, self.report, self.report_files = [], None, []
        self._timings.clear()
        self._run.reset(self._resumed)
        self._resumed = None
        other = self._other_profiler(trainer)
        if other:
            self._run.disabled = True
            rank_zero_warn(stand_down_message(*other))
            return
        directory = self.dirpath or Path(trainer.log_dir or trainer.default_root_dir) / "profiler"
        try:
            store = TraceStore.open(directory, rank=self._rank, max_trace_mb=self.max_trace_mb,
                                    keep=self.num_traces_to_keep)  # fmt: skip
        except TraceNotWrittenError as failure:
            self._run.give_up(failure.what, failure.why)
            return
        self.traces = store.traces
        self._marks.hook_modules(pl_module, self._run.recording)
        rank_zero_info(f"ProfilerSchedule: traces go to {directory}")
        self._saves.wrap(trainer, lambda: self._pause("checkpoint"),
                         lambda fetching: self._pause_ends("checkpoint", fetching))  # fmt: skip
        cuda = (ProfilerActivity.CUDA,) if self._device.type == "cuda" else ()
        self._run.start(store, analyse=self._analyse, activities=(ProfilerActivity.CPU, *cuda),
                        compiled_parts=_compat.has_compiled_parts(pl_module))  # fmt: skip

    # -- the step's phases -----------------------------------------------------------------------

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:  # fmt: skip
        now, recording = time.perf_counter(), self._run.recording()
        self._marks.forward(recording)
        self._timings.batch_starts(now, timed=not recording)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           loss: torch.Tensor) -> None:  # fmt: skip
        self._marks.backward(self._run.recording())

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._marks.backward_ends()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: Any) -> None:  # fmt: skip
        self._marks.optimizer_step(self._run.recording())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:  # fmt: skip
        if self._run.disabled and self._run.profiler is None:
            return
        self._marks.close_all()
        self._timings.batch_ends(None if self._run.recording() else time.perf_counter())
        self._marks.fetch(self._run.step_ends())  # a window's fetch is marked too

    # -- pauses: validation and checkpoint saves are not data wait -------------------------------

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pause("validation")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pause_ends("validation", fetching=False)

    def _pause(self, name: str) -> bool:
        """Validation or a checkpoint save begins; whether it interrupted a marked fetch."""
        self._timings.pause()
        return self._marks.pause(name, self._run.recording())

    def _pause_ends(self, name: str, fetching: bool) -> None:
        self._marks.pause_ends(name, fetching, self._run.recording())

    # -- the end of a fit ------------------------------------------------------------------------

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """A checkpoint loaded by validate() or test() is not a run to resume: only fit's
        restore, which on_train_start takes, is."""
        self._resumed = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._saves.restore()
        self._run.finish()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:  # fmt: skip
        self._saves.restore()
        if self._run.recording():
            self._marks.aborted()
        self._run.end_window()

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self._run.steps, "windows": self._run.windows, "delay": self._run.delay}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = (int(state_dict["steps"]), int(state_dict["windows"]),
                         int(state_dict.get("delay", 0)))  # fmt: skip

    def _analyse(self, raw: Path, path: Path) -> None:
        """The window's report, next to the traces; a failure here costs only the report."""
        made = analyse_window(raw, path, rank=self._rank, device=self._device,
                              warn_once=self._run.warn_once, unprofiled=self._timings.medians(),
                              callbacks=self._callbacks, analyze=analyze_trace)  # fmt: skip
        if made is not None:
            self.report, self.report_files = made


def _trace_folder(dirpath: Any) -> Path | None:
    """``dirpath`` as a path, refused now when it cannot be a folder (a file, under one,
    not writable) rather than found out when the fit writes its first trace."""
    if dirpath is None:
        return None
    fix = "pass a folder you can write to (created if missing), or None for the log dir"
    return _validation.directory("dirpath", dirpath, fix=fix)
