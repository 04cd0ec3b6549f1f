"""SpeedMonitor's FLOP bookkeeping: which steps to count, and FLOPs per batch shape.

A step is counted (by the operator counter of :mod:`lightning_speedkit.measure.flops`)
once per distinct batch shape, up to a number of shapes; other shapes are estimated
from the counted ones (:class:`FlopBook`). :class:`CountSchedule` decides which step
counts: none while compiled parts still compile (under the count they run eagerly
and compile nothing, so the compile would move to the next step), none while torch's
profiler records (up to ``PROFILED_SKIPS`` steps), and none once the shape is known.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lightning_speedkit import _compat, _surgery
from lightning_speedkit.measure._batch_info import BatchInfo, number
from lightning_speedkit.measure._flop_owners import Owners
from lightning_speedkit.measure.flops import _Counter

#: Steps per fit a FLOP count waits for torch's profiler to be off (a ProfilerSchedule
#: window); past them it counts under the profiler (a profiler open for the whole fit).
PROFILED_SKIPS = 16


@dataclass
class Counted:
    """FLOPs counted on one step, with the batch's samples and tokens (a checkpoint entry)."""

    samples: int
    tokens: int | None
    model: float
    hardware: float


class FlopBook:
    """Counted FLOPs per batch signature, and estimates for signatures not counted.

    Example::

        >>> book = FlopBook()
        >>> book.add("a", Counted(samples=4, tokens=None, model=400.0, hardware=500.0))
        >>> book.for_batch(BatchInfo(signature=(((8, 3), "float32"),), samples=8, tokens=None))
        (800.0, 1000.0)
    """

    def __init__(self) -> None:
        self.counted: dict[str, Counted] = {}
        self._estimates: dict[str, tuple[float, float] | None] = {}
        self._fits: dict[int, tuple[Callable[[float], float], Callable[[float], float]]] = {}
        self.unchecked: set[str] = set()
        """Counts from before this fit (a checkpoint's, an earlier fit's) that no count of
        this fit has confirmed: its callbacks or model may differ (activation
        checkpointing added changes the hardware FLOPs)."""

    def recheck(self) -> None:
        """A fit starts: every count so far is to be confirmed by one of this fit's."""
        self.unchecked = set(self.counted)

    def add(self, key: str, counted: Counted) -> None:
        """Book ``counted`` for ``key``. A count of a shape counted before this fit
        confirms those earlier counts where it equals that shape's, and drops them where
        it does not (the model runs otherwise now)."""
        if key in self.unchecked:
            if counted != self.counted[key]:
                for stale in self.unchecked:
                    del self.counted[stale]
            self.unchecked = set()
        self.counted[key] = counted
        self._estimates.clear()  # a new point changes the fit
        self._fits.clear()

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """The counts by signature, as checkpoints keep them."""
        return {key: vars(counted) for key, counted in self.counted.items()}

    def load_state_dict(self, state_dict: dict[str, dict[str, Any]]) -> None:
        """Replace the counts with a checkpoint's (:meth:`state_dict`)."""
        self.counted.clear()
        self._estimates.clear()
        self._fits.clear()
        for key, counted in state_dict.items():
            self.counted[key] = Counted(**counted)
        self.recheck()

    def for_batch(self, info: BatchInfo) -> tuple[float, float] | None:
        """(model, hardware) FLOPs of a batch: counted, or estimated once per shape."""
        counted = self.counted.get(info.key)
        if counted is not None:
            return counted.model, counted.hardware
        if info.key not in self._estimates:
            self._estimates[info.key] = self.estimate(info)
        return self._estimates[info.key]

    def estimate(self, info: BatchInfo) -> tuple[float, float] | None:
        """(model, hardware) FLOPs of a shape not counted: a least-squares fit in tokens
        among counted batches of as many samples, else the closest counted batch scaled
        by tokens (or samples); None before any count.

        The fit is a parabola where one goes through four or more counts exactly (a
        transformer's FLOPs at ``b`` samples of ``T`` tokens are ``a b T + c b T^2``, the
        square from attention: a line fitted to short sequences read a 256-token batch
        26% low), else a line (padding makes the counts no function of the real tokens).
        """
        if not self.counted:
            return None
        same = [c for c in self.counted.values() if c.samples == info.samples and c.tokens]
        if info.tokens is not None and len({c.tokens for c in same}) >= 2:
            fits = self._fits.get(info.samples)
            if fits is None:  # once per count added: a shape a step would refit each step
                xs = [float(c.tokens or 0) for c in same]
                fits = _fit(xs, [c.model for c in same]), _fit(xs, [c.hardware for c in same])
                self._fits[info.samples] = fits
            x = float(info.tokens)
            return max(0.0, fits[0](x)), max(0.0, fits[1](x))
        # Otherwise scale the closest counted batch by samples (and tokens when known).
        ref = min(
            self.counted.values(),
            key=lambda c: (
                abs(c.samples - info.samples),
                abs((c.tokens or 0) - (info.tokens or 0)),
            ),
        )
        scale = info.samples / ref.samples
        if info.tokens and ref.tokens:
            scale = info.tokens / ref.tokens
        return ref.model * scale, ref.hardware * scale


def _fit(xs: list[float], ys: list[float]) -> Callable[[float], float]:
    """``y`` as a function of ``x`` by least squares over ``(xs, ys)``: the parabola where
    four or more distinct points lie on one (to a relative 1e-9), else the line."""
    if len(set(xs)) >= 4:
        scale = max(xs)  # columns of order 1: a well-conditioned solve
        design = torch.tensor([[1.0, v / scale, (v / scale) ** 2] for v in xs], dtype=torch.float64)
        target = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
        coef = torch.linalg.lstsq(design, target).solution.squeeze(1)
        residual = float((design @ coef - target.squeeze(1)).abs().max())
        if residual <= 1e-9 * max(abs(y) for y in ys):
            a, b, c = (float(v) for v in coef)
            return lambda x: a + b * (x / scale) + c * (x / scale) ** 2
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((v - mean_x) ** 2 for v in xs)
    slope = sum((v - mean_x) * (y - mean_y) for v, y in zip(xs, ys, strict=True)) / var
    return lambda x: mean_y + slope * (x - mean_x)


class FlopSession:
    """A FLOP count spanning two hooks (batch start to batch end).

    While open it holds a dispatch mode and global module hooks, so every operator in
    the process goes through Python: :meth:`close` must run whatever the loop does.
    """

    def __init__(self) -> None:
        self.tracker = Owners()
        self.counter = _Counter(self.tracker)
        self.tracker.__enter__()
        try:
            self.counter.__enter__()
        except BaseException:
            self.tracker.__exit__()
            raise

    def close(self) -> tuple[float, float]:
        """Stop counting; (model, hardware) FLOPs of what ran while open."""
        try:
            self.counter.__exit__(None, None, None)
        finally:
            self.tracker.__exit__()
        total = float(self.counter.total)
        return total - self.counter.recomputed, total


class Compilations(Protocol):
    """What :class:`CountSchedule` reads of a compile watch (``CompileWatch``)."""

    @property
    def compilations(self) -> int: ...

    def remove(self) -> None: ...


class CountSchedule:
    """Which training steps get a FLOP count, and the count in flight (one fit).

    Args:
        book: where counts go (it outlives the fit: a resumed run's shapes are known).
        max_counts: distinct batch shapes counted at most.
        profiling: whether torch's profiler records now (tests pass their own).

    Example::

        >>> import torch
        >>> schedule = CountSchedule(FlopBook(), max_counts=1, profiling=lambda: False)
        >>> info = BatchInfo(signature=(((2, 2), "float32"),), samples=2, tokens=None)
        >>> schedule.step_start(info)
        >>> _ = torch.ones(2, 2) @ torch.ones(2, 2)  # 2 x 2 x 2 multiply-adds
        >>> schedule.step_end(info), schedule.book.counted[info.key].model
        (True, 16.0)
    """

    def __init__(
        self,
        book: FlopBook,
        max_counts: int,
        profiling: Callable[[], bool] = _compat.torch_profiler_enabled,
    ) -> None:
        self.book = book
        book.recheck()  # one fit's schedule: earlier counts are confirmed by this fit's
        self.max_counts = max_counts
        self._profiling = profiling
        self._session: FlopSession | None = None
        self._compiles: Compilations | None = None
        self._compiled_before = 0
        self._settled = True
        self._profiled_skips = 0
        self._work_before = 0
        self._redone = 0
        self._served_before = 0.0
        self.served = 0.0
        """FLOPs the last ended step served from a store instead of running."""

    def watch(self, compiles: Compilations) -> None:
        """Compiled parts: count only after a step that compiled nothing, and tell a step
        that compiled (:attr:`untimed`). Watched until :meth:`close`: a new shape, or a
        guard that fails later (a hook taken off a compiled block), compiles again."""
        self._compiles, self._settled = compiles, False

    def stop_watch(self) -> None:
        if self._compiles is not None:
            self._compiles.remove()
            self._compiles = None

    def close(self) -> None:
        """End the fit's counting: no count left open, no compile watch left installed."""
        self.drop()
        self.stop_watch()

    def drop(self) -> None:
        """Close a FLOP count whose batch never reached its end (the LightningModule's
        ``on_train_batch_start`` returned -1, or the loop stopped or failed mid-batch) and
        forget it: a count cut off is no count of that shape."""
        session, self._session = self._session, None
        if session is not None:  # never leave the dispatch mode and module hooks behind
            session.close()

    def step_start(self, info: BatchInfo) -> None:
        """A training step begins: open a count when this step is the one to count."""
        self.drop()  # the previous batch's, if its end hook never ran
        if self._compiles is not None:
            self._compiled_before = self._compiles.compilations
        self._work_before = _surgery.first_call_work()
        self._served_before = _surgery.served_flops()
        if self.counts(info.key):
            self._session = FlopSession()

    @property
    def counting(self) -> bool:
        """Whether the step running now is counted (and so slower: left out of timings)."""
        return self._session is not None

    @property
    def untimed(self) -> bool:
        """Whether the step running now is slower than the training's steps: counted, or it
        has compiled (a recompilation takes from a second to minutes: one such step in a
        short run's timings was its whole summary)."""
        compiled = self._compiles is not None and (
            self._compiles.compilations != self._compiled_before
        )
        return self.counting or compiled

    def counts(self, key: str) -> bool:
        """Whether this batch's step is the one to count FLOPs on: a shape not counted yet,
        within ``max_counts``, or one counted before this fit, to confirm that count."""
        book = self.book
        known = key in book.counted and key not in book.unchecked
        full = key not in book.counted and len(book.counted) >= self.max_counts
        if not self.max_counts or known or full:
            return False
        if not self._settled:
            # Under the count, compiled blocks run eagerly: a step that would compile them
            # would compile nothing, and the compile would move to the next step, where
            # ProfilerSchedule (which waits for a step that compiles nothing) now profiles.
            return False
        if self._profiled_skips < PROFILED_SKIPS and self._profiling():
            # A profiled step would record every operator passing through the counter.
            self._profiled_skips += 1
            return False
        return True

    def step_end(self, info: BatchInfo) -> bool:
        """A training step ended: book its count, if counted (returned); settle the compiles.

        ``served`` is then the FLOPs this step's modules did not spend, served from a
        store (FrozenFeatureCache): the book keeps a shape's FLOPs with nothing served,
        and each step's own figure is that less what it served (:func:`step_flops`).
        """
        session, self._session = self._session, None
        self.served = _surgery.served_flops() - self._served_before
        if session is not None:
            model, hardware = session.close()
            model, hardware = model + self.served, hardware + self.served
            if _surgery.first_call_work() != self._work_before and self._redone < PROFILED_SKIPS:
                # The kit did one-time work in this step (a swap's check, attention found by
                # tracing, checkpoints paused meanwhile): not how later steps run. Count the
                # next step of this shape instead.
                self._redone += 1
                return False
            self.book.add(info.key, Counted(info.samples, info.tokens, model, hardware))
        elif self._compiles is not None:
            # Settled: a whole step ran the compiled parts and compiled nothing.
            self._settled = self._compiles.compilations == self._compiled_before
        return session is not None


def step_flops(
    info: BatchInfo,
    batch: Any,
    book: FlopBook,
    given: Callable[[Any], float] | None,
    served: float = 0.0,
) -> tuple[float, float] | None:
    """(model, hardware) FLOPs of one step: the user's ``flops_per_batch`` for both when
    given, else the book's count or estimate (None before any count), less ``served``,
    the work the step's modules served from a store instead of running."""
    if given is not None:
        flops = number(given(batch), "flops_per_batch")
        return flops, flops
    counted = book.for_batch(info)
    if counted is None or not served:
        return counted
    return max(counted[0] - served, 0.0), max(counted[1] - served, 0.0)
