"""A profiling window held back while torch.compile is still compiling.

Compiling under the profiler records every operator the compiler runs on fake tensors
(with Python stacks: tens of GB of events for a small model, and an out-of-memory
kill). So while a model with compiled parts has not yet run a whole step without
compiling, a window that is due waits a step. What was compiled is read from a
:class:`CompileWatch` (plain Python counters, no device work).
"""

from __future__ import annotations

from typing import Protocol

from lightning_speedkit.measure._compile_watch import CompileWatch

__all__ = ["CompileHold"]


class _Watch(Protocol):
    compilations: int

    def install(self) -> object: ...

    def remove(self) -> None: ...


class CompileHold:
    """Whether a due window waits for torch.compile, from the compilations of each step.

    Args:
        watch: what counts compilations (a :class:`CompileWatch` by default; tests pass
            their own object with a ``compilations`` count).

    Example::

        >>> from types import SimpleNamespace
        >>> watch = SimpleNamespace(compilations=0, install=lambda: None, remove=lambda: None)
        >>> hold = CompileHold(watch)
        >>> hold.begin(compiled_parts=True)
        >>> watch.compilations = 3  # the first step compiles
        >>> hold.step_ends(); hold.held
        True
        >>> hold.step_ends(); hold.held  # a whole step compiled nothing
        False
    """

    def __init__(self, watch: _Watch | None = None) -> None:
        self._watch: _Watch = watch if watch is not None else CompileWatch()
        self.held = False
        """Whether a window that is due now waits a step."""
        self._before_step = 0

    def begin(self, *, compiled_parts: bool) -> None:
        """A fit begins: hold the windows if the model has compiled parts."""
        self.held = compiled_parts
        self._watch.install()
        self._before_step = self._watch.compilations

    def end(self) -> None:
        """Stop counting (profiling is over for this fit)."""
        self._watch.remove()

    def compiled_in_step(self) -> int:
        """Graphs compiled since the last call (or since a window began)."""
        compiled = self._watch.compilations - self._before_step
        self._before_step = self._watch.compilations
        return compiled

    def step_ends(self) -> None:
        """A step outside a window ended: a held window is released by a whole step that
        compiled nothing."""
        if self.held:
            self.held = self.compiled_in_step() > 0

    def window_begins(self) -> None:
        """A window begins: what it compiles is counted from here."""
        self._before_step = self._watch.compilations
