"""Whether a module tree the kit has learned may have changed since.

Two parts of the kit learn something of a model once and keep it: the buffers and
counters of a checkpointed block (``distributed/_replayed_state``) and the layers of a
transformers model that can checkpoint (``attention/_hf_checkpointing``). What they
learned holds until a module or buffer is registered on one of the modules they walked.
torch's global registration hooks (installed once, at the first :func:`watch`) count
those registrations, and only those: a forward that builds a new container each call
(transformers slices ``self.layers[:n]``, a new ``nn.ModuleList``) registers into a
module nobody walked, and changes no generation.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
)

__all__ = ["generation", "watch"]

_watched: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_generation = [0]
_hooks: list[Any] = []


def watch(modules: Iterable[nn.Module]) -> int:
    """Count registrations on ``modules`` from now on; the generation now."""
    if not _hooks:
        _hooks.append(register_module_module_registration_hook(_module_registered))
        _hooks.append(register_module_buffer_registration_hook(_buffer_registered))
    _watched.update(modules)
    return _generation[0]


def generation() -> int:
    """A number that changes whenever a watched module gains, loses or swaps a submodule or
    a buffer name."""
    return _generation[0]


def _module_registered(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    if module in _watched:
        _generation[0] += 1


def _buffer_registered(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    # A buffer reassigned (``self.ema = ...``) stays in its slot; a new name, or a slot
    # emptied or filled (None), is a new structure.
    if module in _watched and (
        tensor is None or not isinstance(getattr(module, name, None), torch.Tensor)
    ):
        _generation[0] += 1
