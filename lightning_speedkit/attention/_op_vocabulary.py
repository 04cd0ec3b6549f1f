"""The torch calls the ``traced`` family knows by name, and how it reads their arguments.

Shared by discovery (:mod:`._discovery`, which records a first call) and the fused
forward (:mod:`._traced`, which runs the module's own forward with its attention
fused): which calls are products, projections, casts, score and weight ops, which
only read metadata, and where their tensors and arguments are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

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


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _broadcasts_into(t: Tensor, shape: tuple[int, ...]) -> bool:
    try:
        return tuple(torch.broadcast_shapes(t.shape, shape)) == shape
    except RuntimeError:
        return False
