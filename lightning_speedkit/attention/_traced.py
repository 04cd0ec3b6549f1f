"""The ``traced`` family: attention found by what a module computes, whatever its names.

Found by :mod:`._discovery` on a module's first call; this module runs it fused.

The module keeps its own forward, run under a ``TorchFunctionMode`` that defers
the first product: it returns a placeholder tensor that records the scale, the
additive bias, the boolean mask (``masked_fill`` with ``-inf`` or a large
negative), the softmax and the attention dropout applied to it, and the
second product calls the backend on the query, key and value as they
reached the products (in SDPA's ``(B, H, N, D)`` layout). Everything else
(projections, head reshapes, rotary embeddings, normalisations, a
``context`` argument, caches) runs as the module wrote it. A placeholder
used any other way is computed eagerly on the spot, so the module's
numbers never depend on what was understood; the parity check then refuses
a module whose attention weights had to be computed (heads mixed after the
softmax, weights returned), and it keeps its own forward.

A mask built from the module's buffers alone (not from its inputs, its
parameters or other attributes) that is lower-triangular becomes
``is_causal=True``, so flash kernels can run; it is checked once per recipe
and shape (a host-device sync).
Under ``torch.compile`` the module's own forward is traced instead, but on a packed
batch, whose call leaves the graph and runs here eagerly, each document apart.

The parts live apart: the torch calls known by name (:mod:`._op_vocabulary`), the
first product that becomes a placeholder (:mod:`._first_product`; ``baddbmm``'s first
tensor is an additive mask, diffusers' classic processor's), the
placeholder and the replay of the module's own code (:mod:`._deferred_scores`), the
mapping of operands onto the fused call's layout (:mod:`._sdpa_layout`), and masks
made from buffers, causal or not (:mod:`._mask_recipes`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_speedkit import _compat
from lightning_speedkit.attention import _documents
from lightning_speedkit.attention._deferred_scores import (
    _SELF,
    Op,
    _cast_dtype,
    _descends,
    _fill,
    _is_plain,
    _Placeholder,
    _Scores,
)
from lightning_speedkit.attention._first_product import first_product
from lightning_speedkit.attention._mask_recipes import BufferRecipes, _negative, sdpa_mask
from lightning_speedkit.attention._op_vocabulary import (
    _ADD,
    _CASTS,
    _DIV,
    _FILL,
    _METADATA,
    _MUL,
    _PRODUCTS,
    _SUB,
    _arg,
    _broadcasts_into,
    _inplace,
    _name,
    _number,
    _softmax_dim,
    _tensor_args,
)
from lightning_speedkit.attention._sdpa_layout import (
    _arrange,
    _einsum_operands,
    _einsum_terms,
    _letter_sizes,
    _mask4d,
    _product_dtype,
    _to4d,
)

tree_flatten, _ = _compat.tree_flatten_and_map()


_NESTING = [0]


@contextlib.contextmanager
def swapped_call() -> Iterator[None]:
    """Around a swapped module's call: recordings and fusions of enclosing modules pause."""
    _NESTING[0] += 1
    try:
        yield
    finally:
        _NESTING[0] -= 1


class SwapRefusedError(Exception):
    """Raised by an adapter's forward during a parity check: this call cannot run fused."""


@dataclass
class TracedAttention:
    """The binding of a traced swap: what discovery saw, and the masks checked so far."""

    detail: str
    causal: dict[Any, bool] = field(default_factory=dict)
    """Whether a mask made from buffers alone is SDPA's causal one, by its recipe and shape."""


class _Fuse(TorchFunctionMode):
    """Runs a module's own forward with its attention products fused (see the module docstring)."""

    def __init__(self, attend: Callable[..., Tensor], binding: TracedAttention, module: nn.Module):
        super().__init__()
        self.attend = attend
        self.binding = binding
        self.depth = _NESTING[0]
        self.recipes = BufferRecipes(module)
        self.fused = 0
        self.unfused: str | None = None

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if _NESTING[0] != self.depth:  # inside another swapped module: not ours
            return func(*args, **kwargs)
        name = _name(func)
        tensors = list(_tensor_args(args, kwargs))
        placeholders = [t for t in tensors if isinstance(t, _Placeholder)]
        if placeholders:
            if name in _METADATA:
                with _compat.disable_torch_function_subclass():
                    return func(*args, **kwargs)
            out = self._on_placeholder(func, name, args, kwargs)
            if out is not None:
                return out
            if self.unfused is None and any(p.scores.softmax for p in placeholders):
                self.unfused = f"its attention weights are used by `{name}`"
            return func(*_fill(args, None), **_fill(kwargs, None))  # computed as written
        if name in _PRODUCTS:
            placeholder = first_product(func, name, args, kwargs, self.recipes)
            if placeholder is not None:
                return placeholder
        out = func(*args, **kwargs)
        if name not in _METADATA:
            self.recipes.note(name, args, kwargs, tensors, out)
        return out

    # ------------------------------------------------------ ops on placeholders

    def _on_placeholder(
        self, func: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """What this op makes of placeholders (one, or the fused output), else ``None``."""
        if name in _PRODUCTS:
            return self._second_product(name, args, kwargs)
        if name == "where":
            return self._where(func, args, kwargs)
        if len(args) == 2 and name in _MUL and isinstance(args[1], _Placeholder):
            args = (args[1], args[0])  # c * scores
        if not args or not isinstance(args[0], _Placeholder):
            return None
        this: _Placeholder = args[0]
        s = this.scores
        rest = args[1:]
        op: Op = (func, (_SELF, *rest), kwargs)
        inplace = _inplace(name)

        def result(scores: _Scores, dtype: torch.dtype | None = None) -> _Placeholder:
            if inplace:
                this.scores = scores
                return this
            return _Placeholder(scores, this.eager_shape, dtype or this.eager_dtype)

        if s.of is not None:  # a row maximum: only ``.detach()`` keeps it one
            return result(s.derive(op)) if name == "detach" else None
        if name in _CASTS:
            dtype = _cast_dtype(name, rest, kwargs, this)
            return None if dtype is None else result(s.derive(op), dtype)
        if s.softmax:
            return self._on_weights(name, args, kwargs, s, op, result)
        if name in _MUL or name in _DIV:
            if len(rest) != 1 or kwargs or not _number(rest[0]):
                return None
            c = float(rest[0]) if name in _MUL else 1.0 / float(rest[0])
            if not 0 < c < math.inf:
                return None
            bias = None if s.bias is None else s.bias * c
            recipe = None if s.mask_recipe is None else (*s.mask_recipe, ("scale", c))
            return result(s.derive(op, scale=s.scale * c, bias=bias, mask_recipe=recipe))
        if name in _ADD or name in _SUB:
            return self._add(name, rest, kwargs, this, op, result)
        if name in _FILL:
            if len(rest) != 2 or kwargs:
                return None
            mask, value = rest
            if not isinstance(mask, Tensor) or mask.dtype != torch.bool or not _negative(value):
                return None
            if not _broadcasts_into(mask, this.eager_shape):
                return None
            keep = ~mask if s.keep is None else s.keep & ~mask
            return result(
                s.derive(
                    op, keep=keep, mask_recipe=self.recipes.extend(s.mask_recipe, "fill", mask)
                )
            )
        if name == "amax":
            dim = _arg(args, kwargs, 1, "dim", ())
            dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
            last = len(this.eager_shape) - 1
            if _arg(args, kwargs, 2, "keepdim", False) and dims in ([-1], [last]):
                rowmax = s.derive(op, of=s)
                return _Placeholder(rowmax, (*this.eager_shape[:-1], 1), this.eager_dtype)
            return None
        if name == "softmax":
            ndim = len(this.eager_shape)
            if _softmax_dim(args, kwargs, ndim) != ndim - 1:
                return None
            dtype = next(
                (a for a in (*rest, kwargs.get("dtype")) if isinstance(a, torch.dtype)), None
            )
            return result(s.derive(op, softmax=True), dtype)
        return None

    def _add(
        self,
        name: str,
        rest: tuple[Any, ...],
        kwargs: dict[str, Any],
        this: _Placeholder,
        op: Op,
        result: Callable[..., _Placeholder],
    ) -> _Placeholder | None:
        s = this.scores
        alpha = kwargs.get("alpha", 1)
        if len(rest) != 1 or set(kwargs) - {"alpha"} or not _number(alpha):
            return None
        other = rest[0]
        if _number(other):
            return result(s.derive(op))  # the same shift for every score: softmax ignores it
        if isinstance(other, _Placeholder):
            rowmax = other.scores.of
            if name in _SUB and rowmax is not None and _descends(s, rowmax):
                return result(s.derive(op))  # minus the row maximum: a shift too
            return None
        if not isinstance(other, Tensor) or not _broadcasts_into(other, this.eager_shape):
            return None
        sign = float(alpha) if name in _ADD else -float(alpha)
        term = other if sign == 1.0 else other * sign
        bias = term if s.bias is None else s.bias + term
        return result(
            s.derive(
                op, bias=bias, mask_recipe=self.recipes.extend(s.mask_recipe, "add", other, sign)
            )
        )

    def _on_weights(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        s: _Scores,
        op: Op,
        result: Callable[..., _Placeholder],
    ) -> _Placeholder | None:
        """After the softmax: attention dropout, or nothing."""
        if name != "dropout":
            return None
        p = _arg(args, kwargs, 1, "p", 0.5)
        training = _arg(args, kwargs, 2, "training", True)
        if not _number(p) or _arg(args, kwargs, 3, "inplace", False):
            return None
        if not training or p == 0:
            return result(s.derive(op))
        return None if s.dropout_p else result(s.derive(op, dropout_p=float(p)))

    def _where(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _Placeholder | None:
        """``torch.where(keep, scores, large negative)``."""
        if len(args) != 3 or kwargs or not isinstance(args[1], _Placeholder):
            return None
        cond, this, value = args
        s = this.scores
        if s.softmax or s.of is not None or not isinstance(cond, Tensor):
            return None
        if cond.dtype != torch.bool or not _negative(value):
            return None
        if not _broadcasts_into(cond, this.eager_shape):
            return None
        keep = cond if s.keep is None else s.keep & cond
        op: Op = (func, (cond, _SELF, value), kwargs)
        derived = s.derive(
            op, keep=keep, mask_recipe=self.recipes.extend(s.mask_recipe, "where", cond)
        )
        return _Placeholder(derived, this.eager_shape, this.eager_dtype)

    # ----------------------------------------------------------- second product

    def _second_product(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Tensor | None:
        """``weights @ v``: the fused attention, in the layout the module's code expects."""
        if name in ("matmul", "bmm"):
            if len(args) != 2 or kwargs or not isinstance(args[0], _Placeholder):
                return None
            weights, v = args
            s = weights.scores
            shape = weights.eager_shape
            if not s.softmax or not _is_plain(v) or v.ndim < 2 or v.shape[-2] != shape[-1]:
                return None
            batch = shape[:-2]
            try:
                if tuple(torch.broadcast_shapes(batch, v.shape[:-2])) != batch:
                    return None
            except RuntimeError:
                return None
            v = v.expand(*batch, *v.shape[-2:])
            return self._fused(s, v, _product_dtype(v.device, weights.eager_dtype, v.dtype))
        if name != "einsum" or kwargs or not args or not isinstance(args[0], str):
            return None
        operands = _einsum_operands(args)
        if len(operands) != 2:
            return None
        first = isinstance(operands[0], _Placeholder)
        weights, v = operands if first else operands[::-1]
        if not isinstance(weights, _Placeholder) or not _is_plain(v) or not weights.scores.softmax:
            return None
        shapes = [weights.eager_shape, tuple(v.shape)]
        parsed = _einsum_terms(args[0], [len(t) for t in (shapes if first else shapes[::-1])])
        if parsed is None:
            return None
        (ta, tb), out = parsed
        tw, tv = (ta, tb) if first else (tb, ta)
        nb = len(shapes[0]) - 2
        lead, i, j = tw[:nb], tw[nb], tw[nb + 1]
        extra = [c for c in tv if c not in tw]
        if j not in tv or len(extra) != 1 or set(tv) - set(lead) - {j, extra[0]}:
            return None
        e = extra[0]
        if sorted(out) != sorted(lead + i + e):
            return None
        sizes = _letter_sizes([tw, tv], shapes)
        if any(sizes[c] != shapes[0][p] for p, c in enumerate(tw)):
            return None
        v = _arrange(v, tv, lead + j + e, sizes)
        dtype = _product_dtype(v.device, weights.eager_dtype, v.dtype)
        result = self._fused(weights.scores, v, dtype)
        canonical = lead + i + e
        return result if out == canonical else result.permute([canonical.index(c) for c in out])

    def _fused(self, s: _Scores, v: Tensor, dtype: torch.dtype) -> Tensor:
        q, k = s.q, s.k
        batch = tuple(q.shape[:-2])
        mask, causal = sdpa_mask(s, q.shape[-2], k.shape[-2], self.binding.causal)
        if not torch.is_autocast_enabled(q.device.type):
            common = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
            q, k, v = (t.to(common) for t in (q, k, v))
            if mask is not None and mask.is_floating_point():
                mask = mask.to(common)
        out = self.attend(
            _to4d(q),
            _to4d(k),
            _to4d(v),
            attn_mask=None if mask is None else _mask4d(mask, batch),
            is_causal=causal,
            scale=s.scale,
            dropout_p=s.dropout_p,
        )
        out = out.reshape(*batch, *out.shape[-2:])
        self.fused += 1
        return out if out.dtype == dtype else out.to(dtype)


def traced_forward(ctx: Any, *args: Any, **kwargs: Any) -> Any:
    """The ``traced`` family's forward: the module's own, its attention through ``ctx.attend``.

    Compiled code traces the module's own forward (a torch-function mode cannot run under
    dynamo), except on a packed batch: only the swap keeps its documents apart, so that
    call leaves the graph and runs here eagerly.
    """
    if torch.compiler.is_compiling():
        if _documents.active() is None:
            return NotImplemented
        return _eager_traced_forward(ctx, *args, **kwargs)
    return _traced_forward(ctx, *args, **kwargs)


def _traced_forward(ctx: Any, *args: Any, **kwargs: Any) -> Any:
    fuse = _Fuse(ctx.attend, ctx.binding, ctx.module)
    with fuse:
        out = ctx.original(*args, **kwargs)
    returned = [p for p in tree_flatten(out)[0] if isinstance(p, _Placeholder)]
    if fuse.unfused is None and any(p.scores.softmax for p in returned):
        fuse.unfused = "its attention weights are returned"
    out = _fill(out, None)  # a placeholder returned as it is: its value
    if ctx.checking:
        if fuse.unfused is not None:
            raise SwapRefusedError(f"not attention that runs fused: {fuse.unfused}")
        if not fuse.fused:
            raise SwapRefusedError("no attention ran fused on these inputs")
    return out


_eager_traced_forward = torch.compiler.disable(_traced_forward)
