"""The first product of a traced attention: which torch calls become a placeholder.

Under :class:`._traced._Fuse`, a product of two plain activations that can be
``q @ k^T`` (``matmul``, ``bmm``, ``baddbmm``, ``einsum``) is not computed: it returns a
:class:`~._deferred_scores._Placeholder` holding the query and key in a ``(*batch, N,
D)`` layout, the scale, and any bias the call adds (``baddbmm``'s first tensor). What is
then applied to it is recorded by ``_Fuse``; anything this module cannot read is computed
as written (``None`` here).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_speedkit.attention._deferred_scores import Op, _is_plain, _Placeholder, _Scores
from lightning_speedkit.attention._mask_recipes import BufferRecipes
from lightning_speedkit.attention._op_vocabulary import _broadcasts_into, _number
from lightning_speedkit.attention._sdpa_layout import (
    _arrange,
    _einsum_operands,
    _einsum_terms,
    _letter_sizes,
    _product_dtype,
)


def first_product(
    func: Callable[..., Any],
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    recipes: BufferRecipes,
) -> _Placeholder | None:
    """A placeholder for ``q @ k^T`` of two activations (else ``None``: computed as written)."""
    if name in ("matmul", "bmm"):
        if len(args) != 2 or kwargs or not (_is_plain(args[0]) and _is_plain(args[1])):
            return None
        a, b = args
        if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
            return None
        return _scores((func, args, kwargs), a, b.transpose(-1, -2), 1.0)
    if name == "baddbmm":
        return _baddbmm(func, args, kwargs, recipes)
    if name == "einsum":
        return _einsum(func, args, kwargs)
    return None


def _baddbmm(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], recipes: BufferRecipes
) -> _Placeholder | None:
    """diffusers' classic processor: ``baddbmm(empty, q, k^T, beta=0, alpha=scale)``, or
    with its additive mask (``(batch * heads, 1 or Nq, Nk)``) in place of ``empty`` and
    ``beta=1``: ``beta * mask`` is a bias added to the scores."""
    if len(args) != 3 or not all(_is_plain(t) for t in args):
        return None
    alpha, beta = kwargs.get("alpha", 1), kwargs.get("beta", 1)
    if set(kwargs) - {"alpha", "beta"} or not (_number(alpha) and _number(beta)):
        return None
    if not 0 < alpha < math.inf or not math.isfinite(beta):
        return None
    mask, a, b = args
    if a.ndim != 3 or b.ndim != 3 or a.shape[-1] != b.shape[-2]:
        return None
    if not _broadcasts_into(mask, (a.shape[0], a.shape[1], b.shape[2])):
        return None
    if beta == 0:
        return _scores((func, args, kwargs), a, b.transpose(-1, -2), float(alpha))
    if not mask.is_floating_point():
        return None
    bias = mask if beta == 1 else mask * beta
    recipe = recipes.extend((), "add", mask, float(beta))
    op = (func, args, kwargs)
    return _scores(op, a, b.transpose(-1, -2), float(alpha), bias, recipe)


def _scores(
    op: Op,
    q: Tensor,
    k: Tensor,
    scale: float,
    bias: Tensor | None = None,
    mask_recipe: tuple[Any, ...] | None = (),
) -> _Placeholder | None:
    try:
        batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    except RuntimeError:
        return None
    q = q.expand(*batch, *q.shape[-2:])
    k = k.expand(*batch, *k.shape[-2:])
    scores = _Scores(op, None, q, k, scale=scale, bias=bias, mask_recipe=mask_recipe)
    dtype = _product_dtype(q.device, q.dtype, k.dtype)
    return _Placeholder(scores, (*batch, q.shape[-2], k.shape[-2]), dtype)


def _einsum(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> _Placeholder | None:
    if kwargs or not args or not isinstance(args[0], str):
        return None
    operands = _einsum_operands(args)
    if len(operands) != 2 or not all(_is_plain(t) for t in operands):
        return None
    parsed = _einsum_terms(args[0], [t.ndim for t in operands])
    if parsed is None or len(parsed[1]) < 2:
        return None
    (ta, tb), out = parsed
    i, j, batch = out[-2], out[-1], out[:-2]
    if i in tb and j in ta:  # key first
        (ta, tb), operands = (tb, ta), operands[::-1]
    if i not in ta or j not in tb or i in tb or j in ta:
        return None
    contracted = [c for c in ta if c in tb and c not in out]
    if len(contracted) != 1:
        return None
    d = contracted[0]
    if set(ta) - set(batch) - {i, d} or set(tb) - set(batch) - {j, d}:
        return None
    sizes = _letter_sizes([ta, tb], [tuple(t.shape) for t in operands])
    if any(c not in sizes for c in batch):
        return None
    q = _arrange(operands[0], ta, batch + i + d, sizes)
    k = _arrange(operands[1], tb, batch + j + d, sizes)
    scores = _Scores((func, args, kwargs), None, q, k)
    shape = (*q.shape[:-1], k.shape[-2])
    return _Placeholder(scores, tuple(shape), _product_dtype(q.device, q.dtype, k.dtype))
