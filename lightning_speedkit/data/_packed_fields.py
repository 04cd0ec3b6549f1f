"""A packed batch's boundary fields as tensors, whatever container the collate put them in.

A collate of one's own, or transformers' ``DataCollatorWithFlattening(return_tensors="np")``,
gives ``cu_seqlens`` and ``document_ids`` as lists or NumPy arrays; a ``DataLoader`` over
rows packed ahead of time stacks each row's ``cu_seqlens`` into ``(1, n)``. Read as
tensors here, they keep documents apart as PackingCollate's do: skipped, they would leave
every token attending across the documents of its row, silently. Both readers of a packed
batch read its fields here, AttentionSwap (the documents it keeps apart) and SpeedMonitor
(the documents and real tokens it counts), so the two never disagree on what a batch holds.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_speedkit.errors import SpeedkitConfigError

__all__ = [
    "HF_NAMES",
    "ROW_FIELDS",
    "carries_packing",
    "cu_seqlens_values",
    "one_row_offsets",
    "packing_field",
    "row_shaped",
]

#: The fields as transformers' ``DataCollatorWithFlattening`` names them
#: (``return_flash_attn_kwargs=True``, ``return_seq_idx=True``), read when ours are absent.
HF_NAMES = {"cu_seqlens": "cu_seq_lens_q", "document_ids": "seq_idx"}
#: Fields whose ``(rows, S)`` shape gives a batch's rows.
ROW_FIELDS = ("document_ids", "position_ids", "input_ids", "labels")


def carries_packing(batch: Mapping[Any, Any]) -> bool:
    """Whether ``batch`` carries a packing field (ours or transformers' name for it): a
    look at its keys, nothing converted or read."""
    return any(batch.get(key) is not None for pair in HF_NAMES.items() for key in pair)


def packing_field(batch: Mapping[Any, Any], name: str) -> Tensor | None:
    """``batch[name]`` (or transformers' name for it) as an integer tensor; None if absent.

    A list, tuple or array of integers is taken as the tensor it spells; anything else
    is refused with the fix, never skipped.
    """
    for key in (name, HF_NAMES[name]):
        value = batch.get(key)
        if value is None:
            continue
        try:
            tensor = value if isinstance(value, Tensor) else torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            tensor = None
        if tensor is None or tensor.is_floating_point() or tensor.is_complex():
            what = type(value).__name__ if tensor is None else f"a {tensor.dtype} tensor"
            raise SpeedkitConfigError(
                f"`{key}` must hold integers (a tensor, or a list or array of them), got "
                f"{what}; pass the `{name}` PackingCollate returns (or build it with "
                f"dtype=torch.long)."
            )
        return tensor
    return None


def row_shaped(ids: Tensor, batch: Mapping[Any, Any]) -> Tensor:
    """``document_ids`` as ``(rows, S)``: 1-D ids over a batch of 2-D rows (flattened by a
    collate of one's own) take the rows' shape; 1-D ids of one row become ``(1, S)``."""
    if ids.ndim != 1:
        return ids
    rows = next((batch[f] for f in ROW_FIELDS[1:] if isinstance(batch.get(f), Tensor)), None)
    if rows is not None and rows.ndim == 2 and rows.numel() == ids.numel():
        return ids.view(rows.shape)
    return ids.unsqueeze(0)


def one_row_offsets(cu: Tensor) -> Tensor:
    """``cu_seqlens`` as the 1-D offsets it holds: a ``(1, n)`` stack of one row's (a
    ``DataLoader``'s batch of one row packed ahead of time) is taken as its ``n``; any
    other shape is returned as it is. A view: nothing is read."""
    return cu[0] if cu.ndim == 2 and cu.shape[0] == 1 else cu


def cu_seqlens_values(cu: Tensor) -> list[int]:
    """``cu_seqlens`` as a list of offsets, checked: 1-D (a ``(1, n)`` stack of one row's
    is taken as its ``n``), starting at 0, never decreasing."""
    cu = one_row_offsets(cu)
    if cu.ndim != 1:
        raise SpeedkitConfigError(
            f"`cu_seqlens` must be 1-D, the offsets over the batch's rows flattened "
            f"(flash-attn's varlen layout), got shape {tuple(cu.shape)} (one per row, "
            f"stacked?); pass one `cu_seqlens` over all rows, or `document_ids` of shape "
            f"(rows, S), as PackingCollate returns them."
        )
    values = [int(v) for v in cu.tolist()]  # SYNC: the boundaries, once per batch
    if not values or values[0] != 0 or any(b < a for a, b in itertools.pairwise(values)):
        raise SpeedkitConfigError(
            f"`cu_seqlens` must be 1-D, start at 0 and never decrease (flash-attn's varlen "
            f"layout), got {values[:8]}{'...' if len(values) > 8 else ''}; pass the "
            f"`cu_seqlens` PackingCollate returned."
        )
    return values
