"""The ``flash`` backend on a packed batch, flash-attn installed: one variable-length call.

Where the other backends cut the packed rows per document (:func:`._documents.per_document`),
flash-attn's ``flash_attn_varlen_func`` takes the rows flattened to ``(tokens, heads,
head_dim)`` and ``cu_seqlens``, the offsets where each sequence starts: a token sees the
tokens of its own span (a document, or a row's padding) only, causal when the call is.
One kernel call per layer, no mask, no padding computed against real tokens.

Its ``cu_seqlens`` is not the batch's: PackingCollate's leaves the padding out (flash-attn's
layout for unpadded tokens), where the rows flattened here keep it, so every span of every
row is a sequence, padding spans included, offsets cumulated across rows. It is built once
per batch (per device) and kept on the batch's :class:`~._documents.Documents`, so every
layer's call reuses it.

flash-attn cannot run without CUDA; the CPU tests check this path with a stand-in of
``flash_attn_varlen_func`` (its documented semantics, one SDPA call per sequence), and a
CUDA test marked ``flash_attn`` runs the real kernel where it is installed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_speedkit.attention._documents import Documents, not_compiled

__all__ = ["flash_per_document", "varlen_cu_seqlens"]


def varlen_cu_seqlens(documents: Documents, device: torch.device) -> tuple[Tensor, int]:
    """The batch's spans as flash-attn's ``(cu_seqlens, max_seqlen)`` over the flattened
    rows, padding spans included (int32 on ``device``): built at the first call, then reused."""
    key = ("flash_cu_seqlens", str(device))
    cached = documents.cache.get(key)
    if cached is not None:
        return cached
    ends = [
        row * documents.length + end
        for row, spans in enumerate(documents.spans)
        for _, end in spans
    ]  # fmt: skip
    longest = max(end - start for spans in documents.spans for start, end in spans)
    built = (torch.tensor([0, *ends], dtype=torch.int32, device=device), longest)
    documents.cache[key] = built
    return built


@not_compiled
def flash_per_document(
    documents: Documents,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    is_causal: bool,
    scale: float | None,
    dropout_p: float,
) -> Tensor:
    """flash-attn's ``flash_attn_varlen_func`` over the packed rows, documents kept apart.

    ``q``, ``k``, ``v`` are ``(rows, heads, S, head_dim)`` (SDPA's layout; fewer key/value
    heads than query heads is grouped-query attention, native to flash-attn); so is the
    output.
    """
    from flash_attn import flash_attn_varlen_func

    cu_seqlens, longest = varlen_cu_seqlens(documents, q.device)
    rows, heads, length, _ = q.shape

    def flat(t: Tensor) -> Tensor:  # (rows, heads, S, D) -> (rows * S, heads, D), one copy
        return t.transpose(1, 2).reshape(rows * length, t.shape[1], t.shape[3])

    out = flash_attn_varlen_func(
        flat(q), flat(k), flat(v), cu_seqlens, cu_seqlens, longest, longest,
        dropout_p=dropout_p, softmax_scale=scale, causal=is_causal,
    )  # fmt: skip
    return out.view(rows, length, heads, out.shape[-1]).transpose(1, 2)
