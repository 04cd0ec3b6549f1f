"""What RegionalCompile says when it has compiled nothing, and what to do: the texts.

Pure functions of the model and of what :class:`~lightning_speedkit.compute.CompileWatch`
counted; the callback only decides when to say them. Two cases:

- ``"auto"`` found no repeated block (:func:`no_blocks_message`): ``"auto"`` looks for
  classes with two or more instances, and a layer held once and called in a loop
  (ALBERT's), or one layer listed ``n`` times (``nn.ModuleList([layer] * n)``), is one
  instance. The message names the classes to pass as ``blocks=[...]``, the likeliest
  first (:func:`~lightning_speedkit._blocks.block_candidates`).
- the first training step compiled no graph (:func:`first_step_report`): dynamo ran the
  blocks uncompiled. A later fit whose blocks' classes a first step compiled since
  dynamo's caches were last cleared reuses that code and compiles nothing either, and is
  told so without a warning.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_speedkit import _compat
from lightning_speedkit._blocks import block_candidates

__all__ = ["first_step_report", "no_blocks_message"]


class _CompiledSinceReset:
    """Block classes whose code a first training step compiled, since dynamo last dropped
    its compiled code.

    Registered with dynamo as a compile callback that does nothing: ``torch._dynamo.reset()``
    (``torch.compiler.reset()``) drops every compiled frame and clears the callbacks with
    them, so a record no longer registered speaks of code dynamo no longer holds, and a
    fresh one starts empty.
    """

    def __init__(self) -> None:
        self.kinds: weakref.WeakSet[type[nn.Module]] = weakref.WeakSet()

    def __call__(self, *args: Any) -> None:
        return None


_RECORD: list[_CompiledSinceReset] = []  # the one current record, once made


def _compiled_since_reset() -> weakref.WeakSet[type[nn.Module]]:
    handler = _compat.dynamo_callback_handler()
    if not _RECORD or not any(call is _RECORD[0] for call in handler.end_callbacks):
        _RECORD[:] = [_CompiledSinceReset()]  # dynamo was reset: what it compiled is gone
        handler.register_end_callback(_RECORD[0])
    return _RECORD[0].kinds


def no_blocks_message(model: nn.Module, blocks: str | Sequence[type[nn.Module] | str]) -> str:
    """The warning when ``blocks`` found no block in ``model``: why, and which
    ``blocks=[...]`` to pass."""
    candidates = [kind.__name__ for kind in block_candidates(model)[:4]]
    model_name = type(model).__name__
    if isinstance(blocks, str):
        why = (
            f"RegionalCompile: no repeated blocks found in {model_name}, so nothing is "
            f'compiled. "auto" compiles the block classes with two or more instances in one '
            f"`nn.ModuleList` or `nn.Sequential`; a layer held once and called in a loop "
            f"(ALBERT's), or one layer listed n times (`nn.ModuleList([layer] * n)`), is one "
            f"instance."
        )
    else:
        named = ", ".join(b if isinstance(b, str) else b.__name__ for b in blocks)
        why = (
            f"RegionalCompile: `blocks=[{named}]` names no module of {model_name} (below the "
            f"model itself), so nothing is compiled."
        )
    if not candidates:
        return (
            f"{why} Its layers hold no modules of their own: compile the whole model with "
            f"`torch.compile(model)` instead, or remove RegionalCompile."
        )
    listed = ", ".join(candidates)
    return (
        f"{why} Name the block class to compile: `RegionalCompile(blocks=[{candidates[0]}])` "
        f"(classes that can be blocks here: {listed})."
    )


def first_step_report(
    graphs: int, seconds: float, kinds: Sequence[type[nn.Module]], blocks: int
) -> tuple[bool, str]:
    """``(warn, message)`` after the first training step of a fit that compiled ``blocks``
    blocks of the classes ``kinds``, during which dynamo compiled ``graphs`` graphs in
    ``seconds``.

    No graph, and no earlier first step compiled these classes since dynamo last dropped
    its compiled code (``torch._dynamo.reset()``, ``torch.compiler.reset()``): the blocks
    ran uncompiled, and ``warn`` is True. No graph but classes compiled since: a later
    fit reuses their code (an info line). A step that compiled graphs records ``kinds``
    as compiled.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> class Layer(nn.Module): ...
        >>> first_step_report(0, 0.0, [Layer], 3)[0]
        True
        >>> first_step_report(1, 0.4, [Layer], 3)
        (False, 'RegionalCompile: compiled 1 graph(s) in 0.4 s during the first step')
        >>> first_step_report(0, 0.0, [Layer], 3)[0]  # a later fit reuses the code
        False
        >>> torch._dynamo.reset()  # the code is gone: compiling nothing now is wrong
        >>> first_step_report(0, 0.0, [Layer], 3)[0]
        True
    """
    compiled = _compiled_since_reset()
    if graphs:
        compiled.update(kinds)
        return False, (
            f"RegionalCompile: compiled {graphs} graph(s) in {seconds:.1f} s during the first step"
        )
    if all(kind in compiled for kind in kinds):
        return False, (
            "RegionalCompile: nothing compiled during the first step (the blocks' code, "
            "compiled in an earlier fit, is reused)"
        )
    names = ", ".join(kind.__name__ for kind in kinds)
    return True, (
        f"RegionalCompile: the first training step compiled nothing, so the {blocks} blocks "
        f"({names}) ran uncompiled: dynamo skipped their code, as it skips code it does not "
        f"trace (a library on its skip list, a forward marked `torch.compiler.disable`). "
        f'Run once with `TORCH_LOGS="+dynamo"` to see a "skipping: ... (reason: ...)" line '
        f"for each. Then name block classes whose forward is your own code "
        f"(`RegionalCompile(blocks=[MyBlock])`), or compile the whole model with "
        f"`torch.compile(model)` and remove RegionalCompile."
    )
