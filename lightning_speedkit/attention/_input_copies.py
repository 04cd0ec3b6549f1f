"""Copies of a call's inputs for the kit's own runs of a module: a parity check, its
timing, a trace ahead of the call.

Tensors are detached clones (aliasing kept). A key/value cache (a transformers
``Cache``: Idefics3, SmolVLM, Idefics2, Mllama and Gemma 3 build a ``DynamicCache`` in
the outer model and hand it to their language model) is state the forward appends to,
not a value: shared, the check's own run, its fused run, each timing run and the real
call all appended their keys and values to the one object, so the fused run attended
to the own run's keys too (a parity error of 0.29, the module wrongly reverted) and,
with gradients, reached back into the own run's freed graph ("Trying to backward
through the graph a second time"). Here a cache is copied (its tensors detached) into a
snapshot, and each run gets a copy of that snapshot of its own (:func:`caller`); the
user's cache is never touched, so the real call sees it as it would without the kit.

A snapshot costs what the cache holds: nothing much in training, where the model
builds an empty cache per call; the keys and values so far where a caller hands a
filled one (generation), once per run of a module's first checked call.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_speedkit.attention._parity import HALF, Inputs


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a key/value cache a forward appends to: transformers' ``Cache``
    classes, or anything else with their ``update`` and ``get_seq_length`` methods."""
    if isinstance(value, (Tensor, nn.Module, dict)):
        return False
    kind = type(value)
    return callable(getattr(kind, "update", None)) and callable(
        getattr(kind, "get_seq_length", None)
    )


def copy_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], requires_grad: bool, upcast: bool = False
) -> Inputs:
    """Detached copies (aliasing kept: ``mha(x, x, x)`` stays self-attention); a cache as
    a snapshot of its own (see the module's docstring), to be called through :func:`caller`.

    ``upcast``: half-precision tensors become float32 (the reference run).
    """
    memo: dict[int, Tensor] = {}

    def copy_tensor(value: Tensor, grad: bool) -> Tensor:
        if id(value) not in memo:
            clone = value.detach().clone()
            if upcast and clone.dtype in HALF:
                clone = clone.float()
            if grad and clone.is_floating_point():
                # A non-leaf (a view of the leaf): hooks on module inputs, such
                # as count_flops' module tracker, refuse leaves in autograd.grad.
                clone = clone.requires_grad_(True).view_as(clone)
            memo[id(value)] = clone
        return memo[id(value)]

    def copy_value(value: Any) -> Any:
        if isinstance(value, Tensor):
            return copy_tensor(value, requires_grad)
        if is_cache(value):  # its tensors are past keys and values: compared by no one
            return _snapshot(value, lambda t: copy_tensor(t, False))
        if isinstance(value, (tuple, list)):
            return type(value)(copy_value(v) for v in value)
        if isinstance(value, dict):
            return {k: copy_value(v) for k, v in value.items()}
        return value

    return copy_value(args), copy_value(kwargs)


def caller(fn: Callable[..., Any], inputs: Inputs) -> Callable[[], Any]:
    """``fn`` called on ``inputs``, each call with a fresh copy of their caches' snapshots
    (the same tensors otherwise: their gradients are the run's)."""
    if not _holds_cache(inputs):
        return lambda: fn(*inputs[0], **inputs[1])

    def call() -> Any:
        args, kwargs = _fresh(inputs)
        return fn(*args, **kwargs)

    return call


def _holds_cache(value: Any) -> bool:
    if is_cache(value):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_cache(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_cache(v) for v in value.values())
    return False


def _fresh(value: Any) -> Any:
    if is_cache(value):
        return _snapshot(value, lambda t: t.detach().clone())
    if isinstance(value, (tuple, list)):
        return type(value)(_fresh(v) for v in value)
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value


def _snapshot(cache: Any, copy_tensor: Callable[[Tensor], Tensor]) -> Any:
    """A deep copy of ``cache`` whose tensors are ``copy_tensor``'s (``copy.deepcopy``
    refuses a tensor that is not a graph leaf, such as keys computed with gradients);
    modules and streams it refers to are shared, not copied."""
    memo: dict[int, Any] = {}
    seen: set[int] = set()
    stack = [cache]
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, Tensor):
            memo[id(value)] = copy_tensor(value)
        elif isinstance(value, (nn.Module, torch.Stream, torch.cuda.Stream)):
            memo[id(value)] = value
        elif isinstance(value, (tuple, list, set, frozenset)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            stack.extend(vars(value).values())
    return copy.deepcopy(cache, memo)
