"""A model's own gradient checkpointing (transformers', diffusers') under the swap.

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

The setting is entered on every swapped call and every replay of it (one per block the
kit checkpoints), so the model is not walked each time (0.5 ms for a 32-layer Qwen2): the
modules that can checkpoint (those with a ``gradient_checkpointing`` attribute, which
``gradient_checkpointing_enable()`` sets) are learned once per model, and each call
reads only their flags. They are learned again once a module was registered into a
learned model (a global registration hook; the new ``nn.ModuleList`` transformers slices
its layers into on each forward belongs to no model and does not count) or a list
holding one of them changed length (its ``insert`` registers nothing), so a layer added
or replaced after the swap is seen.

diffusers' ``enable_gradient_checkpointing()`` has the same shape (a
``gradient_checkpointing`` flag and a ``_gradient_checkpointing_func`` on each module that
checkpoints its blocks, ``torch.utils.checkpoint`` of ``block.__call__`` by default), and
diffusers' attention is found by tracing a model's first call, at whose end the swaps are
installed: a checkpoint taken in that call recomputed, in backward, the swapped attention
rather than the attention the call ran (``CheckpointError``). Such a call is traced ahead
of itself, without gradients (:mod:`._discovery`, :func:`checkpoints_itself`), and while a
call is traced as it runs these functions run their block unchecked
(:func:`checkpoints_paused`), as the kit's own checkpoints do.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_speedkit import _module_tree, _surgery
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
    layers: list[tuple[Any, Any]] = []
    for layer in _checkpointing_layers(model):
        checkpoint = getattr(layer, "_gradient_checkpointing_func", None)
        if checkpoint is None and model.training and torch.is_grad_enabled():
            _refuse(model, layer)
        if checkpoint is not None and not isinstance(checkpoint, _Replaying):
            layers.append((layer, checkpoint))
    with _checkpoint_functions(layers, lambda checkpoint: _Replaying(checkpoint, own)):
        yield


@contextmanager
def _checkpoint_functions(
    layers: list[tuple[Any, Any]], instead: Callable[[Any], Any]
) -> Iterator[None]:
    """Inside, each ``(layer, checkpoint)`` calls ``instead(checkpoint)`` as its checkpoint
    function; its own again after. A plain attribute: into the instance's dict, without
    nn.Module's ``__setattr__`` (the layers of a model, on every call)."""
    for layer, checkpoint in layers:
        layer.__dict__["_gradient_checkpointing_func"] = instead(checkpoint)
    try:
        yield
    finally:
        for layer, checkpoint in reversed(layers):
            layer.__dict__["_gradient_checkpointing_func"] = checkpoint


def _unchecked(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A layer's checkpoint function while a call is traced as it runs: the block runs as
    it is, nothing recomputed (see the module docstring)."""
    return function(*args, **kwargs)


def checkpoints_itself(model: nn.Module) -> bool:
    """Whether a layer of ``model`` has its own gradient checkpointing on (transformers'
    or diffusers' ``gradient_checkpointing`` flag and ``_gradient_checkpointing_func``)."""
    return any(
        layer.__dict__.get("_gradient_checkpointing_func") is not None
        for layer in _checkpointing_layers(model)
    )


@contextmanager
def checkpoints_paused(model: nn.Module) -> Iterator[None]:
    """Inside, the layers of ``model`` that checkpoint by their own checkpoint function run
    their blocks unchecked: the call is traced, and the swaps installed at its end must not
    be what a checkpoint taken in it recomputes."""
    layers = [
        (layer, checkpoint)
        for layer in _checkpointing_layers(model)
        if (checkpoint := layer.__dict__.get("_gradient_checkpointing_func")) is not None
        and checkpoint is not _unchecked
    ]
    with _checkpoint_functions(layers, lambda _: _unchecked):
        yield


_Lists = nn.ModuleList | nn.Sequential  # their `insert` registers no module


@dataclass(frozen=True)
class _Learned:
    """The modules of a model that can checkpoint, as of ``generation``; weakly held, as
    the model may be one of them, and the dict holding this holds the model weakly."""

    generation: int
    layers: tuple[weakref.ref[nn.Module], ...]
    lists: tuple[tuple[weakref.ref[_Lists], int], ...]  # the lists holding them, and lengths

    def current(self) -> bool:
        if self.generation != _module_tree.generation():
            return False
        for parent, length in self.lists:
            held = parent()
            if held is None or len(held) != length:
                return False
        return True


_learned: weakref.WeakKeyDictionary[nn.Module, _Learned] = weakref.WeakKeyDictionary()


def _checkpointing_layers(model: nn.Module) -> list[Any]:
    """The modules of ``model`` whose checkpointing is on (transformers sets the flag on
    the instance; a layer class's default is False)."""
    learned = _learned.get(model)
    if learned is None or not learned.current():
        learned = _learned[model] = _learn(model)
    on: list[Any] = []
    for ref in learned.layers:
        layer = ref()
        if layer is not None and layer.__dict__.get("gradient_checkpointing", False):
            on.append(layer)
    return on


def _learn(model: nn.Module) -> _Learned:
    modules = list(model.modules())
    generation = _module_tree.watch(modules)
    layers = {id(model): model} if _can_checkpoint(model) else {}
    lists: dict[int, tuple[weakref.ref[_Lists], int]] = {}
    for parent in modules:
        for child in parent.children():
            if _can_checkpoint(child):
                layers[id(child)] = child
                if isinstance(parent, (nn.ModuleList, nn.Sequential)):
                    lists[id(parent)] = (weakref.ref(parent), len(parent))
    refs = tuple(weakref.ref(layer) for layer in layers.values())
    return _Learned(generation, refs, tuple(lists.values()))


def _can_checkpoint(module: nn.Module) -> bool:
    # transformers' own test (`hasattr`), without nn.Module's failed-lookup path.
    return "gradient_checkpointing" in module.__dict__ or hasattr(
        type(module), "gradient_checkpointing"
    )


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
