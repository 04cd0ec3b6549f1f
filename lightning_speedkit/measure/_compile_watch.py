"""CompileWatch: what dynamo compiles while it is installed (graphs, recompiles, seconds).

A measurement, read by the kit's callbacks that report compilation
(:class:`~lightning_speedkit.RegionalCompile`, :class:`~lightning_speedkit.SpeedMonitor`,
:class:`~lightning_speedkit.ProfilerSchedule`): it listens to torch's compile
callbacks, keeps plain Python counters and costs nothing on the device.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from lightning_speedkit import _compat

__all__ = ["CompileWatch"]


def _frame_and_attempt(compile_id: str) -> tuple[str, int]:
    """A dynamo compile id ``"F/N"`` (``"!F/N_k"`` and the like): the frame F and the
    attempt N, 0 for its first compilation."""
    frame, _, attempt = compile_id.lstrip("!").rpartition("/")
    number = attempt.split("_")[0]
    return frame, int(number) if number.isdigit() else 0


class CompileWatch:
    """Counts what dynamo compiles while it is installed: graphs, recompilations, seconds.

    It listens to torch's compile callbacks (``torch._dynamo.callback_handler``), which
    fire around every frame dynamo compiles and every backward graph compiled later.
    A compile id ``"F/N"`` is the N-th compilation of frame F: N above 0 is a
    recompilation (a guard, such as a tensor's shape, failed). Everything dynamo
    compiles in the process while installed is counted, and the counts add up:
    ``graphs`` is the frames compiled plus ``recompiles``. A frame first compiled
    before the watch was installed (in an earlier fit in the same process) counts its
    first compilation here as a graph, not as a recompilation; :attr:`by_frame` keeps
    dynamo's own count, earlier compilations included, which its recompile limit
    counts. Counters are plain Python; reading them costs nothing on the device.

    Args:
        clock: the seconds clock that times each compilation (``time.perf_counter``;
            tests pass their own).

    Example::

        >>> import torch
        >>> watch = CompileWatch().install()
        >>> f = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
        >>> _ = f(torch.ones(2)), f(torch.ones(3))
        >>> watch.remove()
        >>> watch.graphs, watch.recompiles
        (2, 1)
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.graphs = 0
        """Frames compiled, recompilations included (backward graphs not counted apart)."""
        self.recompiles = 0
        """Compilations of a frame this watch had seen compiled before."""
        self.seconds = 0.0
        """Wall time spent compiling, forward and backward graphs."""
        self.compilations = 0
        """Compilations begun, backward graphs included."""
        self.by_frame: Counter[str] = Counter()
        """Recompilations per frame id, as dynamo counts them (against its recompile
        limit): those before the watch was installed included."""
        self._frames: set[str] = set()
        self._latest: dict[str, str] = {}  # frame -> the id of its last compilation seen
        self._started: float | None = None
        self._installed = False

    def install(self) -> CompileWatch:
        if not self._installed:
            handler = _compat.dynamo_callback_handler()
            handler.register_start_callback(self._start)
            handler.register_end_callback(self._end)
            self._installed = True
        return self

    def remove(self) -> None:
        if self._installed:
            handler = _compat.dynamo_callback_handler()
            handler.remove_start_callback(self._start)
            handler.remove_end_callback(self._end)
            self._installed = False

    def _start(self, *args: Any) -> None:
        self._started = self._clock()
        self.compilations += 1

    def _end(self, *args: Any) -> None:
        if self._started is not None:
            self.seconds += self._clock() - self._started
            self._started = None
        trigger = (
            getattr(getattr(args[0], "callback_trigger", None), "name", "DYNAMO") if args else ""
        )
        if trigger != "DYNAMO":
            return  # a backward graph compiled at its first use: time only
        compile_id = str(getattr(args[0], "compile_id", "")) if args else ""
        frame, number = _frame_and_attempt(compile_id)
        self._latest[frame] = compile_id
        self.graphs += 1
        if number > 0:
            self.by_frame[frame] = max(self.by_frame[frame], number)
            if frame in self._frames:  # its first compilation was counted here too
                self.recompiles += 1
        self._frames.add(frame)

    def snapshot(self) -> tuple[int, int, float]:
        return self.graphs, self.recompiles, self.seconds

    def last_reason(self) -> str | None:
        """dynamo's reason for the last recompilation of the frame that recompiled most;
        None when none is recorded (dynamo keeps its last 64 compilations)."""
        if not self.by_frame:
            return None
        frame = max(self.by_frame, key=self.by_frame.__getitem__)
        latest = self._latest.get(frame)
        reasons = [why for compile_id, why in _compat.dynamo_recompile_reasons()
                   if compile_id == latest]  # fmt: skip
        return reasons[-1] if reasons else None

    @property
    def most_recompiled(self) -> int:
        """Recompilations of the frame that recompiled most."""
        return max(self.by_frame.values(), default=0)
