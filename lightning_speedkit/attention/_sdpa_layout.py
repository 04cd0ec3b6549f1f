"""How the operands of a module's attention map onto one fused call's arguments.

The fused call takes SDPA's layout: query, key and value as ``(B, H, N, D)`` and a
mask broadcastable to ``(B, H, Nq, Nk)``. A module's products come in any layout:
``matmul`` over ``(*batch, N, D)``, ``einsum`` with its own letters. These functions
read an ``einsum`` equation, arrange operands into ``(*batch, N, D)``, and reshape
that, and a mask, into SDPA's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _product_dtype(device: torch.device, a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype of a product of ``a`` and ``b`` tensors (autocast's, when it is on there)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return torch.promote_types(a, b)


def _einsum_terms(equation: str, ndims: list[int]) -> tuple[list[str], str] | None:
    """The equation's operand and output terms, ``...`` spelled out in spare letters."""
    equation = equation.replace(" ", "")
    if "->" not in equation:
        return None
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        return None
    if "..." in equation:
        spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation]
        widths = [n - (len(t) - 3) for t, n in zip(terms, ndims, strict=True) if "..." in t]
        width = max(widths, default=0)
        letters = "".join(spare[:width])
        terms = [
            t.replace("...", letters[width - (n - (len(t) - 3)) :]) if "..." in t else t
            for t, n in zip(terms, ndims, strict=True)
        ]
        out = out.replace("...", letters)
    for term, n in zip(terms, ndims, strict=True):
        if len(term) != n or len(set(term)) != len(term) or not term.isalpha():
            return None
    if len(set(out)) != len(out):
        return None
    return terms, out


def _arrange(t: Tensor, have: str, want: str, sizes: dict[str, int]) -> Tensor:
    """``t`` (axes named ``have``) as axes ``want``: permuted, missing axes broadcast."""
    order = [have.index(c) for c in want if c in have]
    if order != list(range(t.ndim)):
        t = t.permute(order)
    for position, letter in enumerate(want):
        if letter not in have:
            t = t.unsqueeze(position)
    target = [sizes[c] for c in want]
    return t if list(t.shape) == target else t.expand(target)


def _letter_sizes(terms: list[str], shapes: list[tuple[int, ...]]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, shapes, strict=True):
        for letter, size in zip(term, shape, strict=True):
            sizes[letter] = max(sizes.get(letter, 1), int(size))
    return sizes


def _einsum_operands(args: tuple[Any, ...]) -> list[Any]:
    if len(args) == 2 and isinstance(args[1], (list, tuple)):
        return list(args[1])
    return list(args[1:])


def _to4d(t: Tensor) -> Tensor:
    """``(*batch, N, D)`` as SDPA's ``(B, H, N, D)``."""
    if t.ndim == 4:
        return t
    if t.ndim == 3:
        return t.unsqueeze(1)
    if t.ndim == 2:
        return t[None, None]
    return t.reshape(-1, *t.shape[-3:])


def _mask4d(mask: Tensor, batch: tuple[int, ...]) -> Tensor:
    """A mask broadcastable to ``(*batch, Nq, Nk)`` as one broadcastable to :func:`_to4d`'s."""
    nb = len(batch)
    if mask.ndim < nb + 2:
        mask = mask.reshape((1,) * (nb + 2 - mask.ndim) + tuple(mask.shape))
    if nb == 2:
        return mask
    if nb == 1:
        return mask.unsqueeze(1)
    if nb == 0:
        return mask[None, None]
    return mask.expand(*batch, *mask.shape[-2:]).reshape(-1, batch[-1], *mask.shape[-2:])
