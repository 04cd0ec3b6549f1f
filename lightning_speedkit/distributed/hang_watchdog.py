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
checkpoint``, ``epoch end`` and ``paused by a kit callback`` (NumWorkersTuner's
search). Ranks at the furthest pair are waiting; every rank at an earlier pair (an
earlier batch, or an earlier phase of the same batch) is behind. One rank sleeping in
its forward pass while the others wait in the backward all-reduce of the same batch is
therefore named; if every rank is at the same pair
(all inside one collective, or all slow), none is named, and the report says so. A
rank that does not answer within a few seconds (its process died, or a C extension
holds its interpreter lock) is named as silent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import lightning as L

from lightning_speedkit import _validation
from lightning_speedkit.distributed._hang_abort import HANG_EXIT_CODE, abort
from lightning_speedkit.distributed._hang_detection import WARMUP_STEPS as WARMUP_STEPS
from lightning_speedkit.distributed._hang_detection import StepWatch, poll_interval
from lightning_speedkit.distributed._hang_report import (
    AFTER_BACKWARD,
    BACKWARD,
    EPOCH_END,
    OPTIMIZER,
    REPORT_FILE,
    SAVING,
    VALIDATING,
    RankProgress,
    late_ranks,
)
from lightning_speedkit.distributed._hang_report import PHASES as PHASES
from lightning_speedkit.distributed._hang_response import HangEvent, HangResponse, Site
from lightning_speedkit.distributed._hang_stacks import check_writable
from lightning_speedkit.distributed._hang_store import ANSWER_WAIT, StoreLink, open_store

__all__ = ["HANG_EXIT_CODE", "HangEvent", "HangWatchdog", "RankProgress", "late_ranks"]

log = logging.getLogger(__name__)

Action = Literal["dump", "abort"]


class _WatchThread:
    """The watchdog's thread and its stop flag. A copy of the callback (``ddp_spawn``
    pickles the Trainer before it starts the ranks; ``copy.deepcopy``) gets a new one,
    not started: a thread belongs to its process."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def __reduce__(self) -> tuple[type[_WatchThread], tuple[()]]:
        return _WatchThread, ()

    def start(self, run: Callable[[threading.Event], None]) -> None:
        """Run ``run(stop)`` in a new thread; ``stop`` is set by :meth:`halt`. Each thread
        has its own: one that outlived its ``halt`` still stops when its look ends."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=run, args=(self._stop,),
                                        name="speedkit-hang-watchdog", daemon=True)  # fmt: skip
        self._thread.start()

    def halt(self, wait: float) -> bool:
        """Tell the thread to stop and wait up to ``wait`` seconds for it; whether one ran."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=wait)
        return thread is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


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
    limit, counted from the step's end. Validation, a checkpoint's save, an epoch's end
    and a pause another kit callback takes on purpose (NumWorkersTuner's search for
    spare cores, which holds every rank) are not watched.

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
        self._answer_wait = ANSWER_WAIT
        self._rank, self._world_size = 0, 1
        self._dir = Path(self.dirpath) if self.dirpath is not None else Path.cwd()
        self._thread = _WatchThread()
        self._store = None
        self._reset()

    def _reset(self) -> None:
        """Forget the previous ``fit``'s steps (hook and thread state)."""
        self._watch = StepWatch(self.timeout, self.factor, self.min_timeout)
        self._response = HangResponse(self.events)

    @property
    def _store(self) -> Any:
        """The rendezvous store (None: one rank, or lost); setting it starts a new link."""
        return self._link.store

    @_store.setter
    def _store(self, store: Any) -> None:
        self._link = StoreLink(store, self._rank)

    @property
    def _steps(self) -> deque[tuple[int, float]]:
        return self._watch.steps

    def threshold(self) -> float:
        """The limit, in seconds, the current step is held to (see the class docstring)."""
        return self._watch.limit()

    @property
    def _site(self) -> Site:
        """This rank, its directory and store; how long rank 0 waits for answers."""
        wait = max(self._answer_wait, 4 * poll_interval(self.timeout, self.min_timeout))
        return Site(self._rank, self._world_size, self._dir, self._link, wait)

    # -- lifecycle ---------------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._stop_thread()
        self._reset()
        self._rank, self._world_size = trainer.global_rank, trainer.world_size
        self._dir = Path(self.dirpath if self.dirpath is not None else trainer.default_root_dir)
        check_writable(self._dir, self._rank, self.dirpath)
        self._store = open_store() if self._world_size > 1 else None
        # Lightning's strategy.setup, after every rank's callback setup, broadcasts the
        # model: no rank trains (and raises an alarm) before every rank has read them.
        self._link.catch_up()
        self._thread.start(self._run)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._stop_thread()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._stop_thread()

    def _stop_thread(self) -> None:
        if self._thread.halt(wait=self._answer_wait + 10):
            # a slow step that ended after the thread's last look
            self._response.recovered(self._watch, self._rank)
        self._store = None  # the connection closes with the last reference

    @property
    def running(self) -> bool:
        """Whether the watchdog thread is alive (between a ``fit``'s setup and its end)."""
        return self._thread.alive

    # -- the step's hot path: a timestamp, nothing else --------------------------------------------

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._watch.start(self._clock(), trainer.global_step)

    def on_before_backward(self, *args: Any) -> None:
        self._watch.enter(BACKWARD, self._clock())

    def on_after_backward(self, *args: Any) -> None:
        self._watch.enter(AFTER_BACKWARD, self._clock())

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._watch.enter(OPTIMIZER, self._clock())

    def on_train_batch_end(self, *args: Any) -> None:
        self._watch.end(self._clock())

    # Validation, a save and an epoch's end may take long for good reasons: unwatched, up to
    # the next batch (or, for validation, its end: the time between steps goes on).

    def on_validation_start(self, trainer: L.Trainer, *args: Any) -> None:
        if not getattr(trainer, "sanity_checking", False):
            self._watch.enter(VALIDATING, self._clock())

    def on_validation_end(self, *args: Any) -> None:
        self._watch.end_validation(self._clock())

    def on_save_checkpoint(self, *args: Any) -> None:
        self._watch.enter(SAVING, self._clock())

    def on_train_epoch_end(self, *args: Any) -> None:
        self._watch.enter(EPOCH_END, self._clock())

    def on_train_end(self, *args: Any) -> None:
        self._watch.enter(EPOCH_END, self._clock())  # the fit's end: no next batch comes

    def speedkit_pause(self, paused: bool) -> None:
        """Another kit callback stops training on purpose, on every rank (NumWorkersTuner's
        search for spare cores): the pause is not watched, nor counted in the step."""
        (self._watch.pause if paused else self._watch.resume)(self._clock())

    # -- the thread --------------------------------------------------------------------------------

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(poll_interval(self.timeout, self.min_timeout)):
            try:
                self._tick(self._clock())
            except Exception:  # the watchdog must never take training down by itself
                log.exception("HangWatchdog: unexpected error on rank %d", self._rank)

    def _tick(self, now: float) -> None:
        """One look: the current step's age, a recovered step, another rank's alarm; after a
        dump, with ``action="abort"``, the end of this process."""
        site = self._site
        if self._response.look(now, self._watch, site) and self.action == "abort":
            abort(site.link, site.world_size, site.wait, stacks=self._response.dump_path,
                  report=site.directory / REPORT_FILE, exit=self._exit)  # fmt: skip
