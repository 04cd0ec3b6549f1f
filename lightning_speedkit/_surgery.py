"""The one place where the kit changes a user's modules.

Techniques that change how a module runs (attention swap, activation
checkpointing) go through here: they replace a module's ``forward`` on the
instance, never its parameters or buffers, so state_dict keys, the optimizer's
parameter references and checkpoints of the unchanged model all stay valid, and
:func:`restore_forward` undoes it exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_speedkit.errors import SpeedkitConfigError

#: Instance attribute holding a forward that the module had before ours (rare: another tool's).
_PREVIOUS = "_speedkit_previous_forward"


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
    instance: Callable[..., Any] | None = module.__dict__.get("forward")
    if instance is not None:
        return instance
    bound: Callable[..., Any] = type(module).forward.__get__(module)
    return bound


def replace_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    """Make ``module(...)`` call ``forward``; parameters and buffers untouched."""
    if "forward" in module.__dict__ and _PREVIOUS not in module.__dict__:
        module.__dict__[_PREVIOUS] = module.__dict__["forward"]
    module.__dict__["forward"] = forward


def restore_forward(module: nn.Module) -> None:
    """Undo :func:`replace_forward`."""
    module.__dict__.pop("forward", None)
    if _PREVIOUS in module.__dict__:
        module.__dict__["forward"] = module.__dict__.pop(_PREVIOUS)


def replaced_forward(module: nn.Module) -> Any:
    """The forward the kit put on ``module`` (marked ``_speedkit``), or ``None``."""
    forward = module.__dict__.get("forward")
    return forward if getattr(forward, "_speedkit", False) else None
