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
Under ``torch.compile`` the module's own forward is traced instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_speedkit import _compat

tree_flatten, tree_map = _compat.tree_flatten_and_map()
log = logging.getLogger(__name__)

_PRODUCTS = frozenset({"matmul", "bmm", "einsum", "baddbmm"})
#: Ops that are a projection when one of their tensor operands is a parameter.
_PROJECTIONS = frozenset({"linear", "addmm", "matmul", "mm", "bmm", "einsum", "conv1d"})
_CASTS = frozenset(
    {"float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous", "clone"}
)
_MUL = frozenset({"mul", "mul_", "multiply", "__mul__", "__rmul__", "__imul__"})
_DIV = frozenset({"div", "div_", "divide", "true_divide", "__truediv__", "__itruediv__"})
_ADD = frozenset({"add", "add_", "__add__", "__radd__", "__iadd__"})
_SUB = frozenset({"sub", "sub_", "subtract", "__sub__", "__isub__"})
_FILL = frozenset({"masked_fill", "masked_fill_"})
#: What may stand between the first product and the softmax.
_SCORE_OPS = _MUL | _DIV | _ADD | _SUB | _FILL | _CASTS | {"where", "amax", "detach"}
#: What may stand between the softmax and the second product.
_WEIGHT_OPS = _CASTS | {"dropout"}
_METADATA = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "ndim",
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "is_floating_point",
        "is_complex",
        "layout",
        "requires_grad",
        "is_cuda",
        "is_cpu",
        "is_meta",
        "is_leaf",
        "__len__",
        "element_size",
        "stride",
        "names",
    }
)
#: A ``masked_fill`` value at or below this is a mask (softmax gives it no weight).
_VERY_NEGATIVE = -1e4


def _name(func: Callable[..., Any]) -> str:
    name: str = getattr(func, "__name__", "")
    if name == "__get__":  # a property (``x.shape``): its getter
        return str(getattr(getattr(func, "__self__", None), "__name__", ""))
    return name


_INPLACE_DUNDERS = frozenset(
    {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__ipow__"}
    | {"__iand__", "__ior__", "__ixor__", "__imatmul__", "__setitem__"}
)


def _inplace(name: str) -> bool:
    """Whether the op writes into its first argument (``add_``, ``+=``, ``x[i] = ...``)."""
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


def _tensor_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Tensor]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, Tensor))


def _tensor_outputs(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [o for o in out if isinstance(o, Tensor)]
    return []


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _softmax_dim(args: tuple[Any, ...], kwargs: dict[str, Any], ndim: int) -> int | None:
    """The softmax's axis, non-negative (``F.softmax``, ``torch.softmax``, ``Tensor.softmax``)."""
    dim = _arg(args, kwargs, 1, "dim", None)
    if not isinstance(dim, int):
        return None
    return dim % ndim if ndim else None


_NESTING = [0]


@contextlib.contextmanager
def swapped_call() -> Iterator[None]:
    """Around a swapped module's call: recordings and fusions of enclosing modules pause."""
    _NESTING[0] += 1
    try:
        yield
    finally:
        _NESTING[0] -= 1


Op = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class SwapRefusedError(Exception):
    """Raised by an adapter's forward during a parity check: this call cannot run fused."""


@dataclass
class TracedAttention:
    """The binding of a traced swap: what discovery saw, and the masks checked so far."""

    detail: str
    causal: dict[Any, bool] = field(default_factory=dict)
    """Whether a mask made from buffers alone is SDPA's causal one, by its recipe and shape."""


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


def _is_plain(t: Any) -> bool:
    """An activation: a floating tensor that is neither a parameter nor a placeholder."""
    if not isinstance(t, Tensor) or isinstance(t, (nn.Parameter, _Placeholder)):
        return False
    return t.is_floating_point()


def _recipe_value(value: Any, recipes: WeakTensorKeyDictionary) -> Any:
    """A hashable stand-in for an argument of an op that makes a constant, or ``_NOT``."""
    if isinstance(value, Tensor):
        return recipes.get(value, _NOT)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if value is Ellipsis:
        return "..."
    if isinstance(value, slice):
        parts = tuple(_recipe_value(v, recipes) for v in (value.start, value.stop, value.step))
        return _NOT if _NOT in parts else ("slice", *parts)
    if isinstance(value, (list, tuple)):
        parts = tuple(_recipe_value(v, recipes) for v in value)
        return _NOT if _NOT in parts else parts
    return _NOT


_NOT = ("not a constant",)
_MAX_RECIPE = 64


class _Fuse(TorchFunctionMode):
    """Runs a module's own forward with its attention products fused (see the module docstring)."""

    def __init__(self, attend: Callable[..., Tensor], binding: TracedAttention, module: nn.Module):
        super().__init__()
        self.attend = attend
        self.binding = binding
        self.depth = _NESTING[0]
        # How each tensor made from the module's buffers alone was made: such a mask is the
        # same at every call of a shape. Inputs, parameters and attributes have no recipe.
        self.recipes: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.maybe: set[int] = set()  # ids of those (a quick first test; ids can be reused)
        for name, buffer in module.named_buffers():
            self.recipes[buffer] = ("buffer", name)
            self.maybe.add(id(buffer))
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
            placeholder = self._defer(func, name, args, kwargs)
            if placeholder is not None:
                return placeholder
        out = func(*args, **kwargs)
        if name not in _METADATA:
            self._note_recipe(name, args, kwargs, tensors, out)
        return out

    def _note_recipe(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[Tensor],
        out: Any,
    ) -> None:
        if tensors and not all(id(t) in self.maybe and t in self.recipes for t in tensors):
            if _inplace(name):  # a constant written with inputs
                self.recipes.pop(tensors[0], None)
            return
        named = tuple(sorted(kwargs.items()))
        recipe = (name, _recipe_value(args, self.recipes), _recipe_value(named, self.recipes))
        if _NOT in recipe or len(repr(recipe)) > 40 * _MAX_RECIPE:
            if tensors:
                self.recipes.pop(tensors[0], None)
            return
        outputs = _tensor_outputs(out)
        if _inplace(name) and tensors:
            outputs = [tensors[0]]  # changed in place: its value has a new recipe
        for index, tensor in enumerate(outputs):
            self.recipes[tensor] = (recipe, index)
            self.maybe.add(id(tensor))

    def _recipe(self, t: Tensor) -> Any:
        return self.recipes.get(t)

    # ------------------------------------------------------------ first product

    def _defer(
        self, func: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _Placeholder | None:
        """A placeholder for ``q @ k^T`` of two activations (else ``None``: computed as written)."""
        if name in ("matmul", "bmm"):
            if len(args) != 2 or kwargs or not (_is_plain(args[0]) and _is_plain(args[1])):
                return None
            a, b = args
            if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
                return None
            return self._scores((func, args, kwargs), a, b.transpose(-1, -2), 1.0)
        if name == "baddbmm":  # diffusers: baddbmm(empty, q, k^T, beta=0, alpha=scale)
            if len(args) != 3 or not all(_is_plain(t) for t in args):
                return None
            alpha = kwargs.get("alpha", 1)
            if kwargs.get("beta", 1) != 0 or set(kwargs) - {"alpha", "beta"}:
                return None
            if not _number(alpha) or not 0 < alpha < math.inf:
                return None
            _, a, b = args
            if a.ndim != 3 or b.ndim != 3 or a.shape[-1] != b.shape[-2]:
                return None
            if tuple(args[0].shape) != (a.shape[0], a.shape[1], b.shape[2]):
                return None
            return self._scores((func, args, kwargs), a, b.transpose(-1, -2), float(alpha))
        if name == "einsum":
            return self._defer_einsum(func, args, kwargs)
        return None

    def _scores(self, op: Op, q: Tensor, k: Tensor, scale: float) -> _Placeholder | None:
        try:
            batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
        except RuntimeError:
            return None
        q = q.expand(*batch, *q.shape[-2:])
        k = k.expand(*batch, *k.shape[-2:])
        scores = _Scores(op, None, q, k, scale=scale)
        dtype = _product_dtype(q.device, q.dtype, k.dtype)
        return _Placeholder(scores, (*batch, q.shape[-2], k.shape[-2]), dtype)

    def _defer_einsum(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
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
            return result(s.derive(op, keep=keep, mask_recipe=self._with(s, "fill", mask)))
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
        return result(s.derive(op, bias=bias, mask_recipe=self._with(s, "add", other, sign)))

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

    def _with(self, s: _Scores, kind: str, mask: Tensor, *extra: Any) -> tuple[Any, ...] | None:
        recipe = self._recipe(mask)
        if s.mask_recipe is None or recipe is None:
            return None
        return (*s.mask_recipe, (kind, recipe, *extra))

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
        derived = s.derive(op, keep=keep, mask_recipe=self._with(s, "where", cond))
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
        mask, causal = self._mask(s, q.shape[-2], k.shape[-2])
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

    def _mask(self, s: _Scores, nq: int, nk: int) -> tuple[Tensor | None, bool]:
        """SDPA's ``attn_mask`` and ``is_causal`` for the scores' masks."""
        keep, bias = s.keep, s.bias
        if keep is None and bias is None:
            return None, False
        if s.mask_recipe is not None:  # made from buffers alone: one answer per recipe and shape
            key = (nq, nk, s.mask_recipe)
            causal = self.binding.causal.get(key)
            if causal is None:
                causal = _lower_triangular(keep, bias, nq, nk)
                self.binding.causal[key] = causal
            if causal:
                return None, True
        if bias is None:
            return keep, False
        return (bias if keep is None else bias.masked_fill(~keep, float("-inf"))), False


def _lower_triangular(keep: Tensor | None, bias: Tensor | None, nq: int, nk: int) -> bool:
    """Whether the masks let each query see exactly the keys at or before it (SDPA's causal)."""
    allowed = keep
    if bias is not None:
        zero = bias == 0
        if not bool((zero | (bias <= _VERY_NEGATIVE)).all()):  # SYNC: once per mask recipe
            return False
        allowed = zero if allowed is None else allowed & zero
    assert allowed is not None
    tril = torch.ones(nq, nk, dtype=torch.bool, device=allowed.device).tril()
    return bool((allowed == tril).all())  # SYNC: once per mask recipe


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


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _negative(value: Any) -> bool:
    return _number(value) and float(value) <= _VERY_NEGATIVE


def _broadcasts_into(t: Tensor, shape: tuple[int, ...]) -> bool:
    try:
        return tuple(torch.broadcast_shapes(t.shape, shape)) == shape
    except RuntimeError:
        return False


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


def traced_forward(ctx: Any, *args: Any, **kwargs: Any) -> Any:
    """The ``traced`` family's forward: the module's own, its attention through ``ctx.attend``."""
    if torch.compiler.is_compiling():
        return NotImplemented  # compiled code traces the module's own forward
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
