"""Another torch.profiler in the process: whom ProfilerSchedule stands down for, and why.

torch has one profiling session per process: two profilers share it, and whichever
stops first pulls it from under the other (a segfault, not an error). So beside
Lightning's ``PyTorchProfiler`` (``Trainer(profiler="pytorch")``) or a
``torch.profiler.profile`` block around ``fit()``, ProfilerSchedule does nothing and
says which to keep.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.profilers import PyTorchProfiler

from lightning_speedkit import _compat

__all__ = ["other_profiler", "stand_down_message"]

_OURS = ("(ProfilerSchedule writes traces and a report per window), or remove "
         "ProfilerSchedule from the callbacks (`speedkit report TRACE` reads {} traces "
         "too)")  # fmt: skip


def other_profiler(trainer: Any) -> tuple[str, str] | None:
    """Who else runs torch.profiler in this process, if anyone, and how to keep one.

    Example::

        >>> from types import SimpleNamespace
        >>> other_profiler(SimpleNamespace(profiler=None)) is None
        True
    """
    profiler = getattr(trainer, "profiler", None)
    if isinstance(profiler, PyTorchProfiler):
        who = "the Trainer's `profiler=` (Lightning's PyTorchProfiler)"
        return who, "remove `profiler=` from the Trainer " + _OURS.format("Lightning's")
    if _compat.torch_profiler_enabled():
        who = "a torch.profiler session opened around `fit()`"
        block = "remove your own `torch.profiler.profile()` block around `fit()` "
        return who, block + _OURS.format("torch's")
    return None


def stand_down_message(who: str, advice: str) -> str:
    """The warning ProfilerSchedule gives as it stands down beside ``who``."""
    return (
        f"ProfilerSchedule stands down: {who} already runs torch.profiler, and two "
        f"profilers in one process crash it. Keep one: {advice}."
    )
