"""Deferred attention scores: a placeholder that replays the module's own code when used.

The fused forward (:mod:`._traced`) answers the first product of an attention with a
:class:`_Placeholder` of the shape and dtype its eager value would have. The
placeholder's :class:`_Scores` record what the fused call needs (query, key, scale,
bias, masks, softmax, dropout) and how to compute the eager value: each step a call
whose ``_SELF`` arguments are its parent's value. A placeholder used in a way the
fused call cannot stand for is computed on the spot, so the module's numbers never
depend on what was understood; a cast only changes the dtype it stands for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_speedkit import _compat
from lightning_speedkit.attention._op_vocabulary import _METADATA, _name

tree_flatten, tree_map = _compat.tree_flatten_and_map()

Op = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class _Self:
    """Stands for the placeholder's own value in a recorded step."""


_SELF = _Self()


@dataclass
class _Scores:
    """What a placeholder stands for: its eager recipe and its meaning for a fused call."""

    op: Op
    """How to compute it: a call whose ``_SELF`` arguments are ``parent``'s value."""
    parent: _Scores | None
    q: Tensor
    k: Tensor
    """Query and key, ``(*batch, N, D)``; the scores are ``(*batch, Nq, Nk)``."""
    scale: float = 1.0
    bias: Tensor | None = None
    """Added to the scores, in their units."""
    keep: Tensor | None = None
    """Which scores count (``masked_fill`` with a large negative elsewhere)."""
    mask_recipe: tuple[Any, ...] | None = ()
    """How the masks were made, when from buffers alone (``None``: from inputs)."""
    softmax: bool = False
    dropout_p: float = 0.0
    of: _Scores | None = None
    """For a row maximum (a stabilising shift): the scores it is the maximum of."""
    value: Tensor | None = None

    def derive(self, op: Op, **changes: Any) -> _Scores:
        return dataclasses.replace(self, op=op, parent=self, value=None, **changes)

    def compute(self) -> Tensor:
        """The eager value (what the module's own code would have computed)."""
        if self.value is None:
            func, args, kwargs = self.op
            parent = self.parent.compute() if self.parent is not None else None
            self.value = func(*_fill(args, parent), **_fill(kwargs, parent))
        return self.value


def _fill(value: Any, parent: Tensor | None) -> Any:
    def one(item: Any) -> Any:
        if item is _SELF:
            return parent
        if isinstance(item, _Placeholder):
            return item.scores.compute()
        return item

    return tree_map(one, value)


class _Placeholder(Tensor):
    """A deferred tensor (no storage) with the shape and dtype its eager value would have."""

    scores: _Scores
    eager_shape: tuple[int, ...]
    eager_dtype: torch.dtype
    """Its shape and dtype as plain attributes (``.shape`` would go through torch functions)."""

    @staticmethod
    def __new__(cls, scores: _Scores, shape: tuple[int, ...], dtype: torch.dtype) -> _Placeholder:
        placeholder: _Placeholder = _compat.make_wrapper_subclass(
            cls, shape, dtype=dtype, device=scores.q.device, requires_grad=False
        )
        placeholder.scores = scores
        placeholder.eager_shape = tuple(shape)
        placeholder.eager_dtype = dtype
        return placeholder

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # Outside the fusing mode (a placeholder kept past the forward): compute it.
        kwargs = kwargs or {}
        if _name(func) in _METADATA:
            with _compat.disable_torch_function_subclass():
                return func(*args, **kwargs)
        return func(*_fill(args, None), **_fill(kwargs, None))

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        raise RuntimeError(
            f"AttentionSwap: deferred attention scores reached {func} without being computed; "
            "please report this with the module's code."
        )


def _is_plain(t: Any) -> bool:
    """An activation: a floating tensor that is neither a parameter nor a placeholder."""
    if not isinstance(t, Tensor) or isinstance(t, (nn.Parameter, _Placeholder)):
        return False
    return t.is_floating_point()


def _descends(scores: _Scores, ancestor: _Scores) -> bool:
    """Whether ``scores`` were made from ``ancestor`` (a row maximum of these very scores)."""
    node: _Scores | None = scores
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False


_FIXED_CASTS = {
    "float": torch.float32,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
}


def _cast_dtype(
    name: str, rest: tuple[Any, ...], kwargs: dict[str, Any], this: _Placeholder
) -> torch.dtype | None:
    """The dtype a cast-like op gives the placeholder; ``None`` when it does more than cast."""
    if name in _FIXED_CASTS:
        return _FIXED_CASTS[name] if not rest and not kwargs else None
    if name in ("contiguous", "clone"):
        return this.eager_dtype if not rest else None
    if name == "type_as":
        return rest[0].dtype if len(rest) == 1 and isinstance(rest[0], Tensor) else None
    if set(kwargs) - {"dtype", "copy", "non_blocking"} or len(rest) > 1:
        return None
    target = rest[0] if rest else kwargs.get("dtype")
    if isinstance(target, torch.dtype) and target.is_floating_point:
        return target
    if name == "to" and isinstance(target, Tensor) and target.device == this.device:
        return target.dtype if target.is_floating_point() else None
    return None
