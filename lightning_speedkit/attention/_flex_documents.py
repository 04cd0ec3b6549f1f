"""The ``flex`` backend on a packed batch: one FlexAttention call with a document mask.

Where the other backends cut the packed rows per document (:func:`._documents.per_document`),
FlexAttention takes the whole rows and a block mask in which a token sees the tokens of
its own span (a document, or a row's padding) only, causal when the call is: one kernel
call, which skips the blocks no document spans. The mask is built once per batch (per
causal flag and device) and kept on the batch's :class:`~._documents.Documents`, so every
layer's call reuses it. Building it evaluates the mask over each row's ``S x S`` tokens
once (``create_block_mask``); the kernel never holds it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_speedkit.attention._documents import Documents, not_compiled
from lightning_speedkit.measure._flop_formulas import attention_flops
from lightning_speedkit.measure.flops import run_unseen

__all__ = ["document_block_mask", "flex_per_document", "run_flex"]


def span_ids(documents: Documents, device: torch.device) -> Tensor:
    """Each token's span index in its row, ``(rows, S)``: equal ids attend to each other."""
    rows = [
        torch.cat([torch.full((end - start,), i, dtype=torch.int32) for i, (start, end) in
                   enumerate(spans)])
        for spans in documents.spans
    ]  # fmt: skip
    return torch.stack(rows).to(device)


def document_block_mask(documents: Documents, causal: bool, device: torch.device) -> Any:
    """The batch's FlexAttention ``BlockMask``: built at the first call, then reused."""
    key = ("flex_block_mask", causal, str(device))
    cached = documents.cache.get(key)
    if cached is not None:
        return cached
    from torch.nn.attention.flex_attention import create_block_mask

    ids = span_ids(documents, device)

    def same_span(batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return ids[batch, q_idx] == ids[batch, kv_idx]

    def same_span_causal(batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (ids[batch, q_idx] == ids[batch, kv_idx]) & (q_idx >= kv_idx)

    mask_mod = same_span_causal if causal else same_span
    length = documents.length
    block_mask = create_block_mask(mask_mod, documents.rows, None, length, length, device=device)
    documents.cache[key] = block_mask
    return block_mask


@not_compiled
def flex_per_document(
    flex: Callable[..., Tensor],
    documents: Documents,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    is_causal: bool,
    scale: float | None,
) -> Tensor:
    """``flex(q, k, v, block_mask=..., ...)`` over the packed rows, documents kept apart."""
    block_mask = document_block_mask(documents, is_causal, q.device)
    return run_flex(flex, q, k, v, block_mask, scale, lambda: [
        (1, end - start, end - start) for spans in documents.spans for start, end in spans
    ])  # fmt: skip


def run_flex(
    flex: Callable[..., Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_mask: Any,
    scale: float | None,
    pieces: Callable[[], list[tuple[int, int, int]]],
) -> Tensor:
    """One FlexAttention call. Under a FLOP count it runs with the count set aside (torch
    runs FlexAttention under no dispatch mode but its own) and is priced as dense attention
    over ``pieces()`` of ``(batch, query length, key length)`` (made only when counted)."""
    gqa = k.shape[1] != q.shape[1]
    return run_unseen(
        lambda: flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa),
        lambda: attention_flops("flex_attention", q.shape[1], q.shape[-1], v.shape[-1], pieces()),
    )
