"""What RegionalCompile says when it has compiled nothing, and what to do: the texts.

Pure functions of the model and of what :class:`~lightning_speedkit.compute.CompileWatch`
counted; the callback only decides when to say them. Two cases:

- ``"auto"`` found no repeated block (:func:`no_blocks_message`): a model that calls one
  layer several times (ALBERT's shared layer, ``nn.ModuleList([layer] * n)``) has one
  instance of it, and ``"auto"`` looks for classes with two or more. The message names
  the classes to pass as ``blocks=[...]``.
- the first training step compiled no graph (:func:`first_step_report`): dynamo ran the
  blocks uncompiled. A later fit that reuses the code an earlier fit compiled for the same
  block classes compiles nothing either, and is told so without a warning.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Sequence

from torch import nn

__all__ = ["block_candidates", "first_step_report", "no_blocks_message"]

#: torch's generic containers: never a block to name.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

#: Block classes whose compiled code a first training step in this process compiled: a
#: later fit with blocks of only these classes reuses it and compiles nothing, rightly.
_COMPILED_KINDS: weakref.WeakSet[type[nn.Module]] = weakref.WeakSet()


def _is_candidate(module: nn.Module) -> bool:
    """A module that could be a block: has modules inside and parameters, not a container."""
    return (
        type(module) not in _CONTAINERS
        and next(module.children(), None) is not None
        and next(module.parameters(), None) is not None
    )


def block_candidates(model: nn.Module, limit: int = 4) -> list[str]:
    """Class names to try as ``blocks=[...]`` in a model without repeated blocks.

    First the classes of modules registered under more than one name (one layer listed
    ``n`` times, ``nn.ModuleList([layer] * n)``), then the other modules that hold
    modules and parameters, outermost first; the model itself and torch's containers
    are never named. At most ``limit`` names.

    Example::

        >>> from torch import nn
        >>> class Layer(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.ff = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> layer = Layer()
        >>> block_candidates(nn.Sequential(nn.Linear(4, 4), nn.ModuleList([layer] * 3)))
        ['Layer']
    """
    names = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    modules = [m for m in model.modules() if m is not model and _is_candidate(m)]
    shared = [type(m).__name__ for m in modules if names[id(m)] > 1]
    others = [type(m).__name__ for m in modules]
    return list(dict.fromkeys(shared + others))[:limit]


def no_blocks_message(model: nn.Module, blocks: str | Sequence[type[nn.Module] | str]) -> str:
    """The warning when ``blocks`` found no block in ``model``: why, and which
    ``blocks=[...]`` to pass."""
    candidates = block_candidates(model)
    model_name = type(model).__name__
    if isinstance(blocks, str):
        why = (
            f"RegionalCompile: no repeated blocks found in {model_name}, so nothing is "
            f'compiled. "auto" compiles the block classes with two or more instances in one '
            f"`nn.ModuleList` or `nn.Sequential`; a layer called several times (ALBERT's "
            f"shared layer, `nn.ModuleList([layer] * n)`) is one instance."
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

    No graph, and no earlier first step in this process compiled these classes: the
    blocks ran uncompiled, and ``warn`` is True. No graph but classes compiled before:
    a later fit reuses their code (an info line). A step that compiled graphs records
    ``kinds`` as compiled.

    Example::

        >>> from torch import nn
        >>> class Layer(nn.Module): ...
        >>> first_step_report(0, 0.0, [Layer], 3)[0]
        True
        >>> first_step_report(1, 0.4, [Layer], 3)
        (False, 'RegionalCompile: compiled 1 graph(s) in 0.4 s during the first step')
        >>> first_step_report(0, 0.0, [Layer], 3)[0]  # a later fit reuses the code
        False
    """
    if graphs:
        _COMPILED_KINDS.update(kinds)
        return False, (
            f"RegionalCompile: compiled {graphs} graph(s) in {seconds:.1f} s during the first step"
        )
    if all(kind in _COMPILED_KINDS for kind in kinds):
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
