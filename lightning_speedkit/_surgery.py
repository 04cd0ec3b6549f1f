"""The one place where the kit changes a user's modules.

Techniques that change how a module runs (attention swap, activation
checkpointing) go through here: they replace a module's ``forward`` on the
instance, never its parameters or buffers, so state_dict keys, the optimizer's
parameter references and checkpoints of the unchanged model all stay valid, and
:func:`restore_forward` undoes it exactly.

The replacement is kept in an attribute, and ``module.forward`` becomes the module's
bound method of one function, the same for every module, that calls it: so
torch.compile traces all instances of a block class into one graph. (With a
per-instance callable as ``forward``, a ``functools.partial`` included, dynamo guards
on its identity and compiles once per instance, and past its recompile limit of 8
blocks not at all.)

Pickle stores a bound method as ``getattr(module, "_call_replaced")``, which no module
has, so a pickled model (or ``torch.save(model)``) saved but did not load. The kit's
bound methods (and only those: any other is reduced exactly as pickle does) are
registered with copyreg and multiprocessing's pickler to pickle as the module, which
the loading side binds again. A model loaded from a pickle keeps the kit's forwards
as they were (checkpointed blocks stay checkpointed, swapped attention stays swapped),
as ``copy.deepcopy`` does.
"""

from __future__ import annotations

import copyreg
import types
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from torch import nn

from lightning_speedkit.errors import SpeedkitConfigError

#: Instance attribute holding a forward that the module had before ours (rare: another tool's).
_PREVIOUS = "_speedkit_previous_forward"
#: Instance attribute holding the kit's forward, which ``module.forward`` calls.
_REPLACED = "_speedkit_forward"


def _call_replaced(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module.forward`` while the kit has replaced it (the same function for every module)."""
    return getattr(self, _REPLACED)(*args, **kwargs)


def _bound(module: nn.Module) -> Callable[..., Any]:
    """``module.forward`` while the kit has replaced it, for ``module``."""
    return types.MethodType(_call_replaced, module)


def _reduce_method(method: types.MethodType) -> tuple[Any, ...]:
    """Pickle a bound method: the kit's as its module, any other as pickle does."""
    if method.__func__ is _call_replaced:
        return _bound, (method.__self__,)
    reduced = method.__reduce__()  # exactly what pickle does without this registration
    assert isinstance(reduced, tuple)  # a bound method reduces to (getattr, (self, name))
    return reduced


copyreg.pickle(types.MethodType, _reduce_method)
ForkingPickler.register(types.MethodType, _reduce_method)


def _install(module: nn.Module, forward: Callable[..., Any]) -> None:
    module.__dict__[_REPLACED] = forward
    module.__dict__["forward"] = _bound(module)


def refuse_wrapped(model: nn.Module, what: str) -> None:
    """Raise if ``model`` is already wrapped by a distributed engine or compiled.

    Its modules must be changed before DDP, FSDP or DeepSpeed wrap them (DDP
    captured the parameters and hooks already) or ``torch.compile`` traced them.
    """
    name = type(model).__name__
    wrapped = {
        "DistributedDataParallel": "DDP",
        "FullyShardedDataParallel": "FSDP",
        "DeepSpeedEngine": "DeepSpeed",
        "OptimizedModule": "torch.compile",
    }
    if name in wrapped:
        raise SpeedkitConfigError(
            f"`{what}` got a model already wrapped by {wrapped[name]} ({name}). Apply it to "
            f"the unwrapped module first (`{what}(model.module)` is too late for DDP's hooks): "
            "call it before wrapping, or use its callback, which runs in `setup` before the "
            "strategy wraps the model."
        )


def original_forward(module: nn.Module) -> Callable[..., Any]:
    """The module's forward as it runs without the kit, bound to the module."""
    if _PREVIOUS in module.__dict__:
        previous: Callable[..., Any] = module.__dict__[_PREVIOUS]
        return previous
    instance: Callable[..., Any] | None = module.__dict__.get(
        _REPLACED, module.__dict__.get("forward")
    )
    if instance is not None:
        return instance
    bound: Callable[..., Any] = type(module).forward.__get__(module)
    return bound


def replace_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    """Make ``module(...)`` call ``forward``; parameters and buffers untouched."""
    current = module.__dict__.get(_REPLACED, module.__dict__.get("forward"))
    if current is not None and _PREVIOUS not in module.__dict__:
        module.__dict__[_PREVIOUS] = current
    _install(module, forward)


def restore_forward(module: nn.Module) -> None:
    """Undo :func:`replace_forward`."""
    module.__dict__.pop(_REPLACED, None)
    module.__dict__.pop("forward", None)
    if _PREVIOUS in module.__dict__:
        previous = module.__dict__.pop(_PREVIOUS)
        if getattr(previous, "_speedkit", False):  # the kit's own, from before: as it was
            _install(module, previous)
        else:
            module.__dict__["forward"] = previous


def replaced_forward(module: nn.Module) -> Any:
    """The forward the kit put on ``module`` (marked ``_speedkit``), or ``None``."""
    forward = module.__dict__.get(_REPLACED)
    return forward if getattr(forward, "_speedkit", False) else None
