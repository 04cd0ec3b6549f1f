"""HangWatchdog: a training step that runs too long: every rank's stacks, the late ranks named.

A job that hangs across many processes says nothing: every rank waits in a collective
for a rank that never arrives, until NCCL's timeout (ten minutes or more) kills it with
an error that names neither the rank nor the line. The watchdog is a thread on every
rank that notices a training step running past its limit and then:

1. writes that rank's Python stacks, every thread, to ``dirpath/hang-rank{R}.txt``
   (a readable traceback per thread, then :mod:`faulthandler`'s raw dump), or to stderr
   where that file cannot be written (the directory is checked at setup, but may go);
2. raises an alarm in the process group's rendezvous store (the TCP key-value store
   the ranks met through, served by its own thread, outside any collective), and
   every other rank's watchdog, seeing it, writes its stacks too, whatever its own
   step is doing (waiting in the collective, loading data, validating);
3. on rank 0, collects where each rank was (the step and the phase of it, published
   by each watchdog to the store) and names the ranks that are behind, in the log,
   in :attr:`HangWatchdog.events` and in ``dirpath/hang-report.txt``;
4. with ``action="abort"``, ends every process with exit status 75 (``EX_TEMPFAIL``,
   "try again") once the stacks are on disk, so that a scheduler restarts the job
   from its last checkpoint; with ``action="dump"`` training goes on, and a slow
   step that finishes is reported as recovered.

What the step hooks do: store a host timestamp (and the step's duration at its end)
in Python attributes. No collective, no device synchronisation, no store traffic in
the step; the thread reads those attributes and talks to the store about once a
second (one small request per rank).

**Which ranks are behind.** Each rank's progress is a (batch, phase) pair: the
training batches it has started in this ``fit``, and the last of these hooks it passed
in that batch: ``forward`` (``on_train_batch_start``: the training step runs),
``backward`` (``on_before_backward``: under DDP, the gradient all-reduce runs here),
``after backward`` (``on_after_backward``), ``optimizer step``
(``on_before_optimizer_step``), ``between steps`` (``on_train_batch_end``: the batch's
end, then the next batch's fetch), and the unwatched ``validating``, ``saving a
checkpoint`` and ``epoch end``. Ranks at the furthest pair are waiting; every
rank at an earlier pair (an earlier batch, or an earlier phase of the same batch) is
behind. One rank sleeping in its forward pass while the others wait in the backward
all-reduce of the same batch is therefore named; if every rank is at the same pair
(all inside one collective, or all slow), none is named, and the report says so. A
rank that does not answer within a few seconds (its process died, or a C extension
holds its interpreter lock) is named as silent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import json
import logging
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch

from lightning_speedkit import _compat, _validation
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["HANG_EXIT_CODE", "HangEvent", "HangWatchdog", "RankProgress", "late_ranks"]

log = logging.getLogger(__name__)

#: Exit status of every process after ``action="abort"``: ``EX_TEMPFAIL`` from sysexits.h,
#: "a temporary failure; the user is invited to retry".
HANG_EXIT_CODE = 75

#: Phases of a training batch, in the order a rank passes them (see the module docstring).
#: The first five are watched; validation, a checkpoint's save and the end of an epoch
#: (until the next batch starts) are not.
PHASES = (
    "forward", "backward", "after backward", "optimizer step", "between steps",
    "validating", "saving a checkpoint", "epoch end",
)  # fmt: skip
_FORWARD, _BACKWARD, _AFTER_BACKWARD, _OPTIMIZER, _BETWEEN = range(5)
_VALIDATING, _SAVING, _EPOCH_END = range(5, 8)

#: Completed steps of a ``fit`` before the relative limit applies (the median needs them).
WARMUP_STEPS = 5
#: How many recent step durations the median is taken over.
_HISTORY = 1000
#: How long rank 0 waits for the other ranks' progress after an alarm, at least (seconds).
_ANSWER_WAIT = 5.0
_PREFIX = "speedkit/hang_watchdog"
_ALARMS, _REPORTS, _LEAVING = "alarms", "reports", "leaving"

Action = Literal["dump", "abort"]


@dataclass(frozen=True)
class RankProgress:
    """Where one rank was when the watchdogs dumped their stacks.

    Attributes:
        rank: The global rank.
        batch: Training batches this rank had started in this ``fit`` (1 is the first;
            0: none yet). Every rank starts the same batches, so equal numbers are the
            same batch.
        step: ``trainer.global_step`` when that batch started (optimizer steps taken).
        phase: The last phase the rank entered, one of :data:`PHASES`.
        seconds: How long it had been in that phase.
    """

    rank: int
    batch: int
    step: int
    phase: str
    seconds: float

    def describe(self) -> str:
        """``rank 1: batch 12 (global step 11), forward for 2.3 s``."""
        return (
            f"rank {self.rank}: batch {self.batch} (global step {self.step}), "
            f"{self.phase} for {self.seconds:.1f} s"
        )


@dataclass(frozen=True)
class HangEvent:
    """One thing the watchdog saw, in :attr:`HangWatchdog.events`.

    Attributes:
        kind: ``"overrun"``: this rank's step ran past its limit (stacks written);
            ``"alarm"``: another rank's step did, and this rank wrote its stacks;
            ``"report"`` (rank 0 only): where every rank was, the late ones in ``behind``;
            ``"recovered"``: the step that overran finished after ``seconds``.
        rank: The rank that recorded the event.
        batch: The batch it concerns (see :attr:`RankProgress.batch`).
        step: ``trainer.global_step`` when that batch started.
        seconds: ``overrun``: how long the step had run; ``recovered``: how long it took;
            ``alarm`` and ``report``: how long this rank had been in its current phase.
        threshold: The limit the step was held to, in seconds.
        path: The stack dump (``overrun``, ``alarm``) or report file written, if any.
        behind: ``report``: the ranks behind, where each was.
        silent: ``report``: the ranks that did not say where they were.
        progress: ``report``: where every rank that answered was.
        between: ``overrun`` and ``recovered``: of the time after the batch's step (its
            end, the next batch's fetch; ``seconds`` counted from the step's end), not of
            the step. Ranks waiting for one stuck there wait between steps too:
            Lightning 2.6 starts every batch with a broadcast from rank 0.
    """

    kind: Literal["overrun", "alarm", "report", "recovered"]
    rank: int
    batch: int
    step: int
    seconds: float
    threshold: float
    path: str | None = None
    behind: tuple[RankProgress, ...] = ()
    silent: tuple[int, ...] = ()
    progress: tuple[RankProgress, ...] = ()
    between: bool = False


def late_ranks(progress: Sequence[RankProgress]) -> list[RankProgress]:
    """The ranks behind the furthest: an earlier batch, or an earlier phase of the same batch.

    Example::

        >>> waiting = RankProgress(rank=0, batch=12, step=11, phase="backward", seconds=2.1)
        >>> sleeping = RankProgress(rank=1, batch=12, step=11, phase="forward", seconds=2.2)
        >>> [p.rank for p in late_ranks([waiting, sleeping])]
        [1]
        >>> late_ranks([waiting])
        []
    """
    if not progress:
        return []

    def position(p: RankProgress) -> tuple[int, int]:
        return p.batch, PHASES.index(p.phase)

    furthest = max(position(p) for p in progress)
    return [p for p in progress if position(p) < furthest]


# The hooks' record of the current batch, replaced whole (one attribute store, so the
# thread never reads half of an update): (batch, phase, phase since, batch start, global step).
_Mark = tuple[int, int, float, float, int]
# A batch and whether its step is over: one overrun (and one dump) each, the step's and the
# time after it.
_Where = tuple[int, bool]


def _where(mark: _Mark | None) -> _Where:
    return (mark[0], mark[1] >= _BETWEEN) if mark is not None else (0, False)


class HangWatchdog(L.Callback):
    """Dump every rank's stacks when a training step runs too long, and name the late ranks.

    The limit a step is held to (:meth:`threshold`):

    - ``timeout`` seconds, when given, from the very first step (set it above your first
      step's compile or autotune time);
    - otherwise ``max(min_timeout, factor x median)``, the median taken over the last
      1000 completed steps of this ``fit``. Until :data:`WARMUP_STEPS` (5) steps of the
      ``fit`` have completed there is no median to trust (``torch.compile``, cuDNN
      autotuning, allocator and DDP bucket warm-up all land there), and a step is allowed
      ``factor x min_timeout`` (10 minutes by default): a slow first step is no alarm,
      a first step that never ends still is.

    The time between steps (a batch's end, the next batch's fetch) is held to the same
    limit, counted from the step's end. Validation, a checkpoint's save and an epoch's
    end are not watched.

    Args:
        timeout: A fixed limit in seconds for every step. ``None`` (default): the relative
            limit above. A fixed limit suits a job whose step time you know; the relative
            one adapts to any model.
        factor: How many median steps a step may take (default 10). Lower catches hangs
            sooner but reports ordinary slow steps (a checkpoint's all-gather, a recompile
            for a new shape); above 1.
        min_timeout: The relative limit's floor in seconds (default 60): keep it above the
            longest step your job has for a good reason (a recompile after the first steps,
            an evaluation inside the training step).
        dirpath: Where ``hang-rank{R}.txt`` (every rank) and ``hang-report.txt`` (rank 0)
            go. ``None``: the Trainer's ``default_root_dir``. On a cluster, a filesystem
            every node shares. A directory that cannot be made or written is refused at
            setup, before training starts.
        action: ``"dump"`` (default): write the stacks, report, and let training go on (a
            step that was only slow finishes, and is reported as recovered). ``"abort"``:
            after the stacks are written and rank 0 has reported, end every process with
            exit status :data:`HANG_EXIT_CODE` (75) and the reason in the log, for a
            scheduler (``torchrun --max-restarts``, SLURM ``--requeue``) to restart from the
            last checkpoint instead of waiting for NCCL's timeout.

    The callback holds no state worth a checkpoint: a resumed run recompiles and warms up
    again, so it starts a new history (and a new warm-up) in every ``fit``.

    Example::

        >>> import lightning as L
        >>> watchdog = HangWatchdog(min_timeout=120, action="abort")
        >>> trainer = L.Trainer(callbacks=[watchdog], logger=False)
        >>> watchdog.threshold()  # no step yet: factor x min_timeout
        1200.0
        >>> watchdog.events
        []
    """

    def __init__(
        self,
        timeout: float | None = None,
        factor: float = 10.0,
        min_timeout: float = 60.0,
        dirpath: str | os.PathLike[str] | None = None,
        action: Action = "dump",
    ) -> None:
        self.timeout = _validation.optional(
            _validation.positive_number, "timeout", timeout, example=600
        )
        self.factor = _validation.number(
            "factor", factor, low=1, low_open=True, example=10,
            hint="a step may take this many median steps",
        )  # fmt: skip
        self.min_timeout = _validation.positive_number("min_timeout", min_timeout, example=60)
        self.dirpath = _validation.optional(_validation.path, "dirpath", dirpath)
        self.action: Action = _validation.choice("action", action, ("dump", "abort"))
        #: What the watchdog saw, oldest first (see :class:`HangEvent`).
        self.events: list[HangEvent] = []
        # Injected in tests: the step clock, and what ends the process.
        self._clock: Callable[[], float] = time.monotonic
        self._exit: Callable[[int], Any] = os._exit
        self._answer_wait = _ANSWER_WAIT
        self._rank, self._world_size = 0, 1
        self._dir = Path(self.dirpath) if self.dirpath is not None else Path.cwd()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._store: Any = None
        self._reset()

    def _reset(self) -> None:
        """Forget the previous ``fit``'s steps (hook and thread state)."""
        self._mark: _Mark | None = None
        self._steps: deque[tuple[int, float]] = deque(maxlen=_HISTORY)  # (batch, seconds)
        # (batch, global step, limit) of a step that overran and has not finished yet
        # (batch, global step, limit, since: None for the step, the batch's end for the time
        # between steps) of an overrun not over yet
        self._overrun: tuple[int, int, float, float | None] | None = None
        self._overrun_seen: _Where = (0, False)  # the last (batch, after its step) overrunning
        self._dumped: _Where | None = None  # where this rank last dumped its stacks
        self._dump_path: str | None = None
        self._alarms_seen = self._reports_seen = self._reported_upto = self._leaving_seen = 0
        self._aborting = False

    # -- the limit ---------------------------------------------------------------------------------

    def threshold(self) -> float:
        """The limit, in seconds, the current step is held to (see the class docstring)."""
        if self.timeout is not None:
            return self.timeout
        # list() of a deque runs in C without releasing the GIL: the hooks cannot change it
        # half-way through.
        durations = [seconds for _, seconds in list(self._steps)]
        if len(durations) < WARMUP_STEPS:
            return self.factor * self.min_timeout
        return max(self.min_timeout, self.factor * statistics.median(durations))

    @property
    def _poll(self) -> float:
        """Seconds between the thread's looks: a tenth of the smallest limit, at most 1 s."""
        floor = self.timeout if self.timeout is not None else self.min_timeout
        return min(1.0, max(0.05, floor / 10))

    # -- lifecycle ---------------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._stop_thread()
        self._reset()
        self._rank, self._world_size = trainer.global_rank, trainer.world_size
        self._dir = Path(self.dirpath if self.dirpath is not None else trainer.default_root_dir)
        self._check_writable()
        self._store = _open_store() if self._world_size > 1 else None
        # Counters of earlier fits stay in the store: only what comes after these is news.
        # Lightning's strategy.setup, after every rank's callback setup, broadcasts the
        # model: no rank trains (and raises an alarm) before every rank has read them.
        self._alarms_seen = self._reported_upto = self._store_call(lambda s: s.add(_ALARMS, 0)) or 0
        self._reports_seen = self._store_call(lambda s: s.add(_REPORTS, 0)) or 0
        self._leaving_seen = self._store_call(lambda s: s.add(_LEAVING, 0)) or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="speedkit-hang-watchdog", daemon=True
        )
        self._thread.start()

    def _check_writable(self) -> None:
        """Refuse, before training starts, a directory the stacks could not be written to:
        at a hang it is too late to ask for another."""
        probe = self._dir / f".write-test-rank{self._rank}"
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            shown = (repr(str(self.dirpath)) if self.dirpath is not None
                     else f"None (the Trainer's default_root_dir, {str(self._dir)!r})")  # fmt: skip
            raise SpeedkitConfigError(
                f"`dirpath` must be a directory the stacks can be written to, got {shown}: "
                f"{error.strerror or error}; pass `dirpath=` a writable directory, on a "
                f"cluster one every node shares."
            ) from error

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._stop_thread()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._stop_thread()

    def _stop_thread(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._answer_wait + 10)
            self._thread = None
            self._check_recovered()  # a slow step that ended after the thread's last look
        self._store = None  # the connection closes with the last reference

    @property
    def running(self) -> bool:
        """Whether the watchdog thread is alive (between a ``fit``'s setup and its end)."""
        return self._thread is not None and self._thread.is_alive()

    # -- the step's hot path: a timestamp, nothing else --------------------------------------------

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = self._clock()
        started = self._mark[0] if self._mark is not None else 0
        self._mark = (started + 1, _FORWARD, now, now, trainer.global_step)

    def _enter(self, phase: int) -> None:
        if self._mark is not None:
            batch, _, _, start, step = self._mark
            self._mark = (batch, phase, self._clock(), start, step)

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        self._enter(_BACKWARD)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._enter(_AFTER_BACKWARD)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        self._enter(_OPTIMIZER)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._mark is not None:
            now = self._clock()
            batch_number, _, _, start, step = self._mark
            self._steps.append((batch_number, now - start))
            self._mark = (batch_number, _BETWEEN, now, start, step)

    # Validation, a save and an epoch's end may take long for good reasons: unwatched, up to
    # the next batch (or, for validation, its end: the time between steps goes on).

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not getattr(trainer, "sanity_checking", False):
            self._enter(_VALIDATING)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._mark is not None and self._mark[1] == _VALIDATING:
            self._enter(_BETWEEN)

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._enter(_SAVING)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._enter(_EPOCH_END)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._enter(_EPOCH_END)  # the fit's end (max_steps mid-epoch): no next batch comes

    # -- the thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            try:
                self._tick(self._clock())
            except Exception:  # the watchdog must never take training down by itself
                log.exception("HangWatchdog: unexpected error on rank %d", self._rank)

    def _tick(self, now: float) -> None:
        """One look: the current step's age, a recovered step, another rank's alarm."""
        mark = self._mark
        batch, phase, since, start, step = mark if mark is not None else (0, _BETWEEN, now, now, 0)
        self._check_recovered()
        dumped = False
        floor = self.timeout if self.timeout is not None else self.min_timeout
        between = phase == _BETWEEN
        age = now - (since if between else start)  # the step's age, or the time since it
        where = _where(mark)
        if phase <= _BETWEEN and where > self._overrun_seen and age > floor:
            limit = self.threshold()  # >= floor: the median is only needed past it
            if age > limit:
                self._overrun_seen = where
                self._overrun = (batch, step, limit, since if between else None)
                path = self._dump_path if self._dumped == where else None
                what = "has been between steps" if between else "step ran"
                if self._dumped != where:
                    # Alarm first (the other ranks start dumping now), then this rank's stacks.
                    count = self._store_call(lambda s: s.add(_ALARMS, 1))
                    if count is not None:
                        self._alarms_seen = count
                    why = f"this rank's {what} {age:.1f} s, past its limit of {limit:.1f} s"
                    path = self._dump(mark, now, why)
                    dumped = True
                self.events.append(HangEvent("overrun", self._rank, batch, step, age, limit,
                                             path, between=between))  # fmt: skip
                log.warning(
                    "HangWatchdog: rank %d: batch %d (global step %d) %s %.1f s, past its "
                    "limit of %.1f s; %s",
                    self._rank, batch, step,
                    "ended and the next has not begun for" if between else "has run",
                    age, limit, _where_stacks_went(path),
                )  # fmt: skip
        count = self._store_call(lambda s: s.add(_ALARMS, 0))
        if count is not None and count > self._alarms_seen:
            self._alarms_seen = count
            if self._dumped != where:
                path = self._dump(mark, now, "another rank's step ran past its limit")
                self.events.append(HangEvent("alarm", self._rank, batch, step, now - since,
                                             self.threshold(), path))  # fmt: skip
                log.warning(
                    "HangWatchdog: rank %d: another rank raised a hang alarm; this rank is at "
                    "batch %d (global step %d), %s; %s",
                    self._rank, batch, step, PHASES[phase], _where_stacks_went(path),
                )  # fmt: skip
                dumped = True
        if not dumped:
            return
        if self._world_size > 1 and self._rank == 0:
            self._report(self._progress(mark, now), self.threshold())
        if self.action == "abort":
            self._abort()

    def _check_recovered(self) -> None:
        if self._overrun is None:
            return
        batch, step, limit, since = self._overrun
        mark = self._mark
        if since is not None:  # the time between steps: over once the rank moved on
            if mark is None or (mark[0], mark[1]) == (batch, _BETWEEN):
                return
            left = mark[2] if mark[0] == batch else mark[3]  # its next phase, or batch, began
            took: float | None = left - since
        else:
            finished = [seconds for b, seconds in list(self._steps) if b == batch]
            took = finished[-1] if finished else None
        if took is not None:
            self._overrun = None
            self.events.append(HangEvent("recovered", self._rank, batch, step, took, limit,
                                         between=since is not None))  # fmt: skip
            log.warning(
                "HangWatchdog: rank %d: batch %d %s after %.1f s (limit %.1f s): it was slow, "
                "not stuck",
                self._rank, batch, "was followed" if since is not None else "finished", took,
                limit,
            )  # fmt: skip
        elif mark is not None and mark[0] != batch:
            self._overrun = None  # it ended unseen (its duration already out of the history)

    def _progress(self, mark: _Mark | None, now: float) -> RankProgress:
        if mark is None:
            return RankProgress(self._rank, 0, 0, PHASES[_BETWEEN], 0.0)
        batch, phase, since, _, step = mark
        return RankProgress(self._rank, batch, step, PHASES[phase], now - since)

    # -- stacks ------------------------------------------------------------------------------------

    def _dump(self, mark: _Mark | None, now: float, why: str) -> str | None:
        """Write this rank's stacks; publish where it is to the store. Returns the file path."""
        self._dumped = _where(mark)
        progress = self._progress(mark, now)
        if self._store is not None:
            answer = json.dumps({**dataclasses.asdict(progress), "alarm": self._alarms_seen})
            self._store_call(lambda s: s.set(f"progress/{self._rank}", answer))
        path = self._dir / f"hang-rank{self._rank}.txt"
        header = _stacks_header(self._rank, self._world_size, why, progress)
        try:
            _write_stacks(path, header)
        except OSError as error:  # the stacks are what a hang leaves: never lose them
            log.error("HangWatchdog: rank %d could not write %s (%s); stacks printed to stderr",
                      self._rank, path, error)  # fmt: skip
            _print_stacks(header)
            self._dump_path = None
            return None
        self._dump_path = str(path)
        return self._dump_path

    # -- rank 0's report ---------------------------------------------------------------------------

    def _report(self, own: RankProgress, limit: float) -> None:
        """Wait for every rank's progress (a few seconds at most); name the late ones."""
        answers: dict[int, RankProgress] = {0: own}
        deadline = time.monotonic() + max(self._answer_wait, 4 * self._poll)
        while self._store is not None and len(answers) < self._world_size:
            for rank in range(1, self._world_size):
                if rank not in answers:
                    found = self._read_progress(rank)
                    if found is not None:
                        answers[rank] = found
            if len(answers) == self._world_size or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        count = self._store_call(lambda s: s.add(_ALARMS, 0))
        self._reported_upto = max(self._reported_upto, count or 0)
        progress = tuple(answers[r] for r in sorted(answers))
        behind = tuple(late_ranks(progress))
        silent = tuple(r for r in range(self._world_size) if r not in answers)
        path = self._dir / "hang-report.txt"
        text = _report_text(progress, behind, silent, limit, self._dir)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            written: str | None = str(path)
        except OSError:
            written = None
        self.events.append(HangEvent("report", 0, own.batch, own.step, own.seconds, limit,
                                     written, behind, silent, progress))  # fmt: skip
        log.warning("%s", text.rstrip())
        self._store_call(lambda s: s.add(_REPORTS, 1))

    def _read_progress(self, rank: int) -> RankProgress | None:
        key = f"progress/{rank}"
        raw = self._store_call(lambda s: s.get(key) if s.check([key]) else None)
        if raw is None:
            return None
        fields = json.loads(raw)
        if int(fields.pop("alarm")) <= self._reported_upto:
            return None  # an answer to an alarm already reported
        return RankProgress(**fields)

    # -- abort -------------------------------------------------------------------------------------

    def _abort(self) -> None:
        """End this process, with the reason, once the ranks have said where they were.

        Rank 0 hosts the store: it leaves last (after its report, when the others have said
        they are leaving, or after a few seconds), so that no rank loses the store midway.
        """
        self._aborting = True
        wait = max(self._answer_wait, 4 * self._poll)
        if self._rank != 0:
            self._wait_for(_REPORTS, self._reports_seen + 1, deadline=time.monotonic() + wait + 3)
            self._store_call(lambda s: s.add(_LEAVING, 1))
        else:
            others = self._leaving_seen + self._world_size - 1
            self._wait_for(_LEAVING, others, deadline=time.monotonic() + 3)
        log.error(
            "HangWatchdog: a training step hung (action='abort'): ending rank %d with exit "
            "status %d. Stacks: %s; rank 0's report: %s. Restart the job from its last "
            "checkpoint; see the troubleshooting page's 'Distributed hangs'.",
            self._rank, HANG_EXIT_CODE, self._dump_path or "printed to stderr above",
            self._dir / "hang-report.txt",
        )  # fmt: skip
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self._exit(HANG_EXIT_CODE)

    def _wait_for(self, key: str, value: int, deadline: float) -> None:
        """Until the counter ``key`` reaches ``value``, the store is gone, or the deadline."""
        while self._store is not None and time.monotonic() < deadline:
            count = self._store_call(lambda s: s.add(key, 0))
            if count is None or count >= value:
                return
            time.sleep(0.05)

    # -- the store ---------------------------------------------------------------------------------

    def _store_call(self, call: Callable[[Any], Any]) -> Any:
        """``call(store)``, or None without a store; a store that fails is dropped, said once."""
        if self._store is None:
            return None
        try:
            return call(self._store)
        except Exception as error:  # the store's host process died, or the network did
            log.log(
                logging.DEBUG if self._aborting else logging.WARNING,
                "HangWatchdog: rank %d lost the rendezvous store (%s); it goes on watching "
                "its own steps only",
                self._rank, error,
            )  # fmt: skip
            self._store = None
            return None


def _open_store() -> Any:
    """A connection of the watchdog's own to the default process group's store, or None.

    The process group's own client is shared with the main thread, which may sit in a
    blocking ``get`` on it (NCCL exchanges its unique id through the store when a
    communicator is first used): a TCP store gets a second client, so the watchdog's
    requests never queue behind it. Another kind of store is used as it is.
    """
    # torch.distributed re-exports them from its C module without declaring it to mypy.
    from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

    store = _compat.default_process_group_store()
    if store is None:
        return None
    base = store
    while isinstance(base, PrefixStore):
        base = base.underlying_store
    if isinstance(base, TCPStore):
        try:
            base = TCPStore(
                base.host, base.port, is_master=False, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=30),
            )  # fmt: skip
        except Exception as error:  # an unreachable host: share the group's connection
            log.debug("HangWatchdog: a second store connection failed (%s)", error)
            base = store
    return PrefixStore(_PREFIX, base)


def _where_stacks_went(path: str | None) -> str:
    return f"stacks written to {path}" if path is not None else "stacks printed to stderr"


def _stacks_header(rank: int, world_size: int, why: str, progress: RankProgress) -> str:
    """Where the rank was and every thread's Python stack, readable (faulthandler's raw dump
    follows it)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    lines = [
        f"HangWatchdog stack dump: rank {rank} of {world_size}, host {socket.gethostname()}, "
        f"pid {os.getpid()}, {datetime.datetime.now(datetime.timezone.utc).isoformat()}",
        f"why: {why}",
        f"where: {progress.describe()}",
        "",
        "--- Python stacks, every thread (most recent call last) ---",
    ]
    frames = sys._current_frames()
    frames.pop(threading.get_ident(), None)  # the watchdog's own: faulthandler shows it below
    main = threading.main_thread().ident
    for ident in sorted(frames, key=lambda i: i != main):  # the main thread first
        lines.append(f"\nThread {names.get(ident, '?')} (id {ident}):")
        lines.extend(line.rstrip("\n") for line in traceback.format_stack(frames[ident]))
    lines += ["", "--- faulthandler (most recent call first) ---", ""]
    return "\n".join(lines) + "\n"


def _write_stacks(path: Path, header: str) -> None:
    """The header, then faulthandler's dump (C-level, all threads), to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        with partial.open("w", encoding="utf-8") as out:
            out.write(header)
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
        os.replace(partial, path)  # a reader never sees half a dump
    finally:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


def _print_stacks(header: str) -> None:
    """The stacks that could not be written, on stderr (faulthandler's dump where stderr
    is a real file: it writes to a file descriptor)."""
    sys.stderr.write(header)
    sys.stderr.flush()
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no file descriptor (a captured stream)
        sys.stderr.write("(faulthandler's dump needs stderr to be a file: left out)\n")


def _report_text(
    progress: Sequence[RankProgress],
    behind: Sequence[RankProgress],
    silent: Sequence[int],
    limit: float,
    directory: Path,
) -> str:
    late = {p.rank for p in behind}
    lines = [f"HangWatchdog: a training step ran past its limit of {limit:.1f} s. "
             f"Where each rank was:"]  # fmt: skip
    lines += [f"  {p.describe()}{'   <- behind' if p.rank in late else ''}" for p in progress]
    lines += [f"  rank {r}: no answer (process gone, or its interpreter lock held)"
              for r in silent]  # fmt: skip
    if behind:
        named = ", ".join(f"rank {p.rank} (batch {p.batch}, {p.phase})" for p in behind)
        lines.append(f"Behind: {named}.")
    elif progress and all(p.phase == PHASES[_BETWEEN] for p in progress):
        lines.append(
            "Behind: no rank by progress: all were between steps of one batch. Lightning "
            "starts each batch with a broadcast from rank 0: the rank whose stacks are not "
            "in `_broadcast_sigterm_tensor` is the one the others wait for."
        )
    else:
        lines.append("Behind: no rank by progress: all were at the same batch and phase.")
    if silent:
        lines.append(f"Silent: {', '.join(f'rank {r}' for r in silent)}.")
    lines.append(f"Stacks: {directory / 'hang-rank{R}.txt'} on each rank's filesystem.")
    return "\n".join(lines) + "\n"
