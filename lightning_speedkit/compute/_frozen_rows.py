"""Which rows and batch fields a cached module's call holds, cutting rows out of it, and
what else its output's numbers depend on (its signature)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from lightning_speedkit import _compat
from lightning_speedkit.compute._frozen_layout import no_row_per_sample

__all__ = [
    "OutputLayout",
    "assemble",
    "batch_field",
    "call_signature",
    "cut_rows",
    "first_row",
    "numerics",
    "same_tensor",
    "stacked",
]

#: What a module's output is rebuilt from: its tree spec, the slots of its tensors among
#: the leaves, the leaf count, and each tensor's dtype, device and order of dimensions in
#: memory (a transformers hidden state may be a transposed view: a reduction over it
#: adds in that order, so a served copy is laid out the same).
OutputLayout = tuple[
    Any, list[int], int, list[torch.dtype], list[torch.device], list[tuple[int, ...]]
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


def call_signature(
    args: tuple[Any, ...], kwargs: dict[str, Any], rows: int
) -> tuple[Hashable, str | None]:
    """What, besides the sample, a call's output depends on; or why the call cannot be
    served (an input that requires grad, or has not ``rows`` rows)."""
    parts: list[Hashable] = []
    batched, device = False, "cpu"
    for where, value in [*enumerate(args), *sorted(kwargs.items())]:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return None, (
                    f"its input `{where}` requires grad (it comes from a trainable "
                    f"module), and a stored output would cut that gradient"
                )
            if value.ndim == 0 or value.shape[0] != rows:
                return None, no_row_per_sample(where, tuple(value.shape), rows)
            batched, device = True, value.device.type
            parts.append((where, tuple(value.shape[1:]), str(value.dtype), value.device.type))
        else:
            parts.append((where, repr(value)[:200]))
    if not batched:
        return None, "it was called with no tensor that has a row per sample"
    return (*parts, *numerics(device)), None


def stacked(rows: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Stored rows stacked in host memory, for a copy to ``device``: page-locked for a CUDA
    device, so that the copy is queued behind the step's work. A copy from pageable memory
    waits for the stream first: on an H200 (2026-11-29) serving a batch of the example's
    tower so took 6.7 ms, the tower's own forward 8.6 ms, and the cache gave 0.97x."""
    if device.type != "cuda":
        return torch.stack(rows)
    # The host allocator keeps the block until the copy has read it (it records the copy).
    staged = torch.empty((len(rows), *rows[0].shape), dtype=rows[0].dtype, pin_memory=True)
    return torch.stack(rows, out=staged)


def assemble(
    found: list[Any], hit: list[int], miss: list[int], computed: Any, rows: int,
    layout: OutputLayout,
) -> Any:  # fmt: skip
    """A call's output of ``rows`` rows: the stored rows ``found`` at ``hit``, the rows
    ``computed`` for the misses at ``miss``, laid out as ``layout`` says."""
    spec, places, count, dtypes, devices, orders = layout
    leaves = []
    fresh: list[torch.Tensor] | None = computed
    for j, (dtype, device) in enumerate(zip(dtypes, devices, strict=True)):
        served = stacked([found[i][j] for i in hit], device).to(
            device=device, dtype=dtype, non_blocking=True
        )
        if fresh is None and served.dim_order() == orders[j]:  # stacked rows lie as computed
            leaves.append(served)
            continue
        whole = torch.empty_permuted(
            (rows, *served.shape[1:]), orders[j], dtype=dtype, device=device
        )
        if fresh is None:
            leaves.append(whole.copy_(served))
            continue
        whole[torch.tensor(hit, device=device)] = served
        whole[torch.tensor(miss, device=device)] = fresh[j].to(dtype)
        leaves.append(whole)
    full: list[torch.Tensor | None] = [None] * count
    for place, leaf in zip(places, leaves, strict=True):
        full[place] = leaf
    return spec.unflatten(full)
