"""Which rows and batch fields a cached module's call holds, cutting rows out of it, and
what else its output's numbers depend on."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from lightning_speedkit import _compat

__all__ = [
    "batch_field",
    "cut_rows",
    "first_row",
    "numerics",
    "same_tensor",
]


def batch_field(fields: dict[Hashable, torch.Tensor], given: list[Any]) -> Hashable | None:
    """Which of the step's batch ``fields`` a call's arguments ``given`` pass as they are
    (the field's name, as the batch carries it), or None."""
    for name, tensor in fields.items():
        if any(same_tensor(value, tensor) for value in given):
            return name
    return None


def same_tensor(value: Any, field: torch.Tensor) -> bool:
    """Whether ``value`` is the batch tensor ``field`` (the object, or a view of all of it)."""
    if value is field:
        return True
    return (
        isinstance(value, torch.Tensor)
        and value.device == field.device
        and value.dtype == field.dtype
        and value.shape == field.shape
        and value.stride() == field.stride()
        and value.numel() > 0
        and value.data_ptr() == field.data_ptr()
    )


def first_row(out: Any) -> Any:
    """``out`` (a module's output for a lone row and its copy) with the copy's row taken off."""
    _, tree_map = _compat.tree_flatten_and_map()
    return tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) and t.ndim else t, out)


def cut_rows(values: Any, rows: list[int], total: int) -> Any:
    """``values`` (args or kwargs) with each batched tensor cut to ``rows``."""

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == total:
            return value.index_select(0, torch.tensor(rows, device=value.device))
        return value

    if isinstance(values, dict):
        return {name: cut(value) for name, value in values.items()}
    return tuple(cut(value) for value in values)


def numerics(device: str) -> tuple[Hashable, ...]:
    """What else decides the output's numbers for a call on ``device``: autocast, when it is
    on (a ``precision="bf16-mixed"`` fit), and float32 matmul precision other than the
    default (TF32). Nothing when neither is set, so that plain calls keep their keys."""
    parts: list[Hashable] = []
    if torch.is_autocast_enabled(device):
        parts.append(("autocast", device, str(torch.get_autocast_dtype(device))))
    if torch.get_float32_matmul_precision() != "highest":
        parts.append(("float32_matmul", torch.get_float32_matmul_precision()))
    return tuple(parts)
