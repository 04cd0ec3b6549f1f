"""ProfilerSchedule's marks: the regions a profiled step's time is attributed to.

Inside a window, ``record_function`` ranges named ``speedkit/<phase>`` mark the phases
of a step (:data:`PHASES`), the pauses that are no step's time (``validation``,
``checkpoint``), and the forward of each top-level module (``speedkit/module/<name>``).
Lightning runs forward and backward inside the optimizer's closure, so each phase is
opened in one hook and closed in the next: :class:`StepMarks` holds that choreography,
given at each call whether the step is recorded. :class:`TimedSaves` gives a checkpoint
save the end that Lightning has no hook for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.profiler import record_function

from lightning_speedkit._blocks import _has_parameters

__all__ = ["MARK", "PHASES", "StepMarks", "TimedSaves"]

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


class StepMarks:
    """The phases of profiled steps, each opened in one hook and closed in a later one.

    Every method that opens a region takes ``recording``: whether the profiler records
    the current step (outside a window, or in its warm-up, nothing is opened). Closing
    a region that is not open costs a dictionary look-up.

    Example::

        >>> import torch
        >>> marks = StepMarks()
        >>> with torch.profiler.profile() as prof:
        ...     marks.forward(recording=True)
        ...     marks.backward(recording=True)
        ...     marks.backward_ends()
        >>> sorted({e.name for e in prof.events() if e.name.startswith(MARK)})
        ['speedkit/backward', 'speedkit/forward']
    """

    def __init__(self) -> None:
        self._regions = _Region()
        self._hooks: list[Any] = []

    def hook_modules(self, module: torch.nn.Module, recording: Callable[[], bool]) -> None:
        """Mark the forward of each of :func:`_marked_modules`, for as long as the hooks
        stay (the whole fit: hooks added to a compiled module later would recompile it)."""
        for name, part in _marked_modules(module):
            self._hooks.append(part.register_forward_pre_hook(self._module_enter(name, recording)))
            self._hooks.append(part.register_forward_hook(self._module_exit(name)))

    def unhook_modules(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _module_enter(self, name: str, recording: Callable[[], bool]) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if recording():
                self._regions.enter(f"module/{name}")

        return hook

    def _module_exit(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            self._regions.exit(f"module/{name}")

        return hook

    def fetch(self, recording: bool) -> None:
        """The next batch is being fetched (closed when it arrives: :meth:`forward`)."""
        if recording:
            self._regions.enter("data_fetch")

    def forward(self, recording: bool) -> None:
        """A batch has arrived: its fetch ends, its forward begins."""
        self._regions.exit("data_fetch")
        if recording:
            self._regions.enter("forward")

    def backward(self, recording: bool) -> None:
        self._regions.exit("forward")
        if recording:
            self._regions.enter("backward")

    def backward_ends(self) -> None:
        self._regions.exit("backward")

    def optimizer_step(self, recording: bool) -> None:
        self._regions.exit("forward")  # a step without backward (skipped loss)
        if recording:
            self._regions.enter("optimizer_step")

    def pause(self, name: str, recording: bool) -> bool:
        """A pause begins (``validation``, a ``checkpoint`` save): not a training step's
        time, nor a fetch's. Whether it interrupted a marked fetch (ModelCheckpoint saves
        after ProfilerSchedule's batch end has opened the next one)."""
        fetching = self._regions.exit("data_fetch")
        if recording:
            self._regions.enter(name)
        return fetching

    def pause_ends(self, name: str, fetching: bool, recording: bool) -> None:
        """The pause ends; a fetch it interrupted goes on (the next batch is still to come)."""
        self._regions.exit(name)
        if fetching and recording:
            self._regions.enter("data_fetch")

    def aborted(self) -> None:
        """The step an exception ended is no step: say so in the trace."""
        self._regions.exit_all()
        self._regions.enter("aborted")
        self._regions.exit("aborted")

    def close_all(self) -> None:
        self._regions.exit_all()


class TimedSaves:
    """Calls around every checkpoint save of one Trainer, until :meth:`restore`.

    Lightning has a hook where a save begins (``on_save_checkpoint``, partway through
    collecting the state) and none where it ends, so the Trainer's ``save_checkpoint``,
    which checkpoint callbacks call, is wrapped.

    Example::

        >>> from types import SimpleNamespace
        >>> calls = []
        >>> trainer = SimpleNamespace(save_checkpoint=lambda path: calls.append(path))
        >>> saves = TimedSaves()
        >>> saves.wrap(trainer, lambda: calls.append("begins") or True,
        ...            lambda began: calls.append(f"ends {began}"))
        >>> trainer.save_checkpoint("last.ckpt")
        >>> saves.restore()
        >>> trainer.save_checkpoint("after.ckpt")
        >>> calls
        ['begins', 'last.ckpt', 'ends True', 'after.ckpt']
    """

    def __init__(self) -> None:
        self._untime: Callable[[], None] | None = None

    def wrap(self, trainer: Any, begins: Callable[[], bool], ends: Callable[[bool], None]) -> None:
        """Call ``begins`` and ``ends(begins())`` around every save of ``trainer`` (those
        of a Trainer wrapped before are restored first)."""
        self.restore()
        save = trainer.save_checkpoint
        previous = vars(trainer).get("save_checkpoint")  # an override of the user's, if any

        @functools.wraps(save)
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = begins()
            try:
                return save(*args, **kwargs)
            finally:
                ends(began)

        def untime() -> None:
            if vars(trainer).get("save_checkpoint") is timed:  # not wrapped again since
                if previous is None:
                    del vars(trainer)["save_checkpoint"]
                else:
                    vars(trainer)["save_checkpoint"] = previous

        vars(trainer)["save_checkpoint"] = timed
        self._untime = untime

    def restore(self) -> None:
        """Put the Trainer's own ``save_checkpoint`` back."""
        untime, self._untime = self._untime, None
        if untime is not None:
            untime()
