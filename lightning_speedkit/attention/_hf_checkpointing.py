"""transformers' own gradient checkpointing under the Hugging Face swap.

``model.gradient_checkpointing_enable()`` gives each checkpointed layer a
``_gradient_checkpointing_func`` (``torch.utils.checkpoint`` with the user's
``use_reentrant``), which the layer calls on its forward. The recomputation runs in
backward, after the swap's call has returned and put the model's attention
implementation back: it ran the model's own attention (``eager``, without the causal
mask transformers leaves out for SDPA's ``is_causal``), so ``use_reentrant=False``
raised ``CheckpointError`` and ``use_reentrant=True`` silently gave other gradients.

While the swap's setting is on (the call, or a recomputation of the kit's own
checkpoint replaying it), each such function is wrapped: the checkpointed forward runs
as it is, and its recomputation under the settings the call ran in (those
:func:`~lightning_speedkit._surgery.call_settings` lists: the attention implementation,
the SDPA kernel, a packed batch's documents), as the kit's own checkpoint replays them.
The functions are put back when the setting ends, so nothing stays on the model: a
model whose checkpointing is enabled after the swap was installed is covered from its
next call, and one whose checkpointing is disabled is left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_speedkit import _surgery
from lightning_speedkit.errors import SpeedkitConfigError


class _Recomputed:
    """A checkpointed forward: its first run is the forward, inside the call and its
    settings; every later run is a recomputation, under ``settings`` replayed."""

    def __init__(self, function: Callable[..., Any], settings: tuple[_surgery.Setting, ...]):
        self.function, self.settings, self.ran = function, settings, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.ran:
            self.ran = True
            return self.function(*args, **kwargs)
        with _surgery.replayed(self.settings):
            return self.function(*args, **kwargs)


class _Replaying:
    """A layer's checkpoint function while a swap's setting is on (see the module docstring)."""

    def __init__(self, checkpoint: Callable[..., Any], own: _surgery.Setting) -> None:
        self.checkpoint, self.own = checkpoint, own

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # the recomputation is traced from this forward
            return self.checkpoint(function, *args, **kwargs)
        # Inside a recomputation of the kit's own checkpoint the settings are replayed, not
        # declared: the swap's own is the one known.
        settings = _surgery.call_settings() or (self.own,)
        return self.checkpoint(_Recomputed(function, settings), *args, **kwargs)


@contextmanager
def replaying_checkpoints(model: nn.Module, own: _surgery.Setting) -> Iterator[None]:
    """Inside, the layers of ``model`` that transformers checkpoints recompute under the
    settings their forward ran in; ``own`` is the swap's setting (see the module docstring)."""
    if torch.compiler.is_compiling():
        yield
        return
    wrapped: list[tuple[Any, Any]] = []
    for module in model.modules():
        layer: Any = module  # transformers' attributes, typed by nn.Module as its own
        # transformers sets the flag on the instance (a layer class's default is False):
        # read from its dict, a module that has none costs no failed attribute lookup.
        if not layer.__dict__.get("gradient_checkpointing", False):
            continue
        checkpoint = getattr(layer, "_gradient_checkpointing_func", None)
        if checkpoint is None and model.training and torch.is_grad_enabled():
            _refuse(model, layer)
        if checkpoint is not None and not isinstance(checkpoint, _Replaying):
            layer._gradient_checkpointing_func = _Replaying(checkpoint, own)
            wrapped.append((layer, checkpoint))
    try:
        yield
    finally:
        for layer, checkpoint in reversed(wrapped):
            layer._gradient_checkpointing_func = checkpoint


def _refuse(model: nn.Module, layer: nn.Module) -> None:
    """A layer that checkpoints by its own code (transformers' format from before 4.35, in a
    model's remote code): its recomputation would run the model's own attention."""
    raise SpeedkitConfigError(
        f"`gradient_checkpointing_enable()` of {type(model).__name__} checkpoints "
        f"{type(layer).__name__} by the model's own code, whose recomputation in backward "
        "cannot run the swapped attention (other gradients); use the kit's "
        "`ActivationCheckpointing` (or `checkpoint_blocks`) in place of transformers' "
        "checkpointing (`model.gradient_checkpointing_disable()`)."
    )
