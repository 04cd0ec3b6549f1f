"""Sequence packing: several samples per row, with the boundaries that keep them apart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["PackingCollate", "document_mask"]


class PackingCollate:
    """Packs variable-length samples into rows of ``max_tokens`` instead of padding each one.

    Samples are placed greedily, in order, into the current row until the next one
    does not fit, then a new row starts; the end of the last row is padded. A
    sample longer than ``max_tokens`` is cut to it. The batch carries what an
    attention kernel needs to keep documents apart:

    - ``cu_seqlens`` (int32, ``[0, len0, len0+len1, ...]``) over the flattened rows,
      padding excluded: flash-attn's ``varlen`` layout;
    - ``position_ids``: restart at 0 in every document;
    - ``document_ids``: the document index of each token, ``-1`` on padding (for
      FlexAttention's document mask, or :func:`document_mask`);
    - ``max_seqlen``: the longest document, as a Python int.

    Other per-sample tensors (images, labels) are stacked in document order.

    Args:
        max_tokens: tokens per packed row.
        key: the sample field holding the token sequence.
        pad_id: the value padding positions get.

    Example::

        >>> collate = PackingCollate(max_tokens=6)
        >>> batch = collate([{"input_ids": torch.tensor([1, 2, 3])},
        ...                  {"input_ids": torch.tensor([4, 5])},
        ...                  {"input_ids": torch.tensor([6, 7, 8, 9])}])
        >>> batch["input_ids"].tolist()
        [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]]
        >>> batch["cu_seqlens"].tolist(), batch["document_ids"][0].tolist()
        ([0, 3, 5, 9], [0, 0, 0, 1, 1, -1])
    """

    def __init__(self, max_tokens: int, key: str = "input_ids", pad_id: int = 0) -> None:
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise SpeedkitConfigError(
                f"`max_tokens` must be a positive integer, got {max_tokens!r}."
            )
        self.max_tokens = max_tokens
        self.key = key
        self.pad_id = pad_id

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        if not samples:
            raise SpeedkitConfigError("PackingCollate got an empty list of samples.")
        rows: list[list[Tensor]] = [[]]
        used = 0
        for sample in samples:
            if self.key not in sample:
                raise SpeedkitConfigError(
                    f"PackingCollate(key={self.key!r}) found no {self.key!r} in a sample with keys "
                    f"{sorted(sample)}; pass the field holding the tokens as `key`."
                )
            seq = torch.as_tensor(sample[self.key])[: self.max_tokens]
            if used + len(seq) > self.max_tokens:
                rows.append([])
                used = 0
            rows[-1].append(seq)
            used += len(seq)

        n_rows = len(rows)
        dtype = torch.as_tensor(samples[0][self.key]).dtype
        ids = torch.full((n_rows, self.max_tokens), self.pad_id, dtype=dtype)
        positions = torch.zeros((n_rows, self.max_tokens), dtype=torch.long)
        documents = torch.full((n_rows, self.max_tokens), -1, dtype=torch.long)
        lengths: list[int] = []
        doc = 0
        for r, row in enumerate(rows):
            offset = 0
            for seq in row:
                n = len(seq)
                ids[r, offset : offset + n] = seq
                positions[r, offset : offset + n] = torch.arange(n)
                documents[r, offset : offset + n] = doc
                lengths.append(n)
                offset += n
                doc += 1
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
        batch: dict[str, Any] = {
            self.key: ids,
            "position_ids": positions,
            "document_ids": documents,
            "cu_seqlens": cu,
            "max_seqlen": max(lengths),
        }
        for field in samples[0]:
            if field != self.key and isinstance(samples[0][field], Tensor):
                batch[field] = torch.stack([s[field] for s in samples])
        return batch


def document_mask(document_ids: Tensor, causal: bool = True) -> Tensor:
    """Boolean attention mask ``(rows, 1, S, S)``: a token sees only its own document.

    Padding (document ``-1``) sees nothing and is seen by nothing, except itself so
    that softmax over a fully masked row stays defined.
    """
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    real = (document_ids >= 0).unsqueeze(-1) & (document_ids >= 0).unsqueeze(-2)
    mask = same & real
    if causal:
        S = document_ids.shape[-1]
        mask &= torch.ones(S, S, dtype=torch.bool, device=document_ids.device).tril()
    mask |= torch.eye(document_ids.shape[-1], dtype=torch.bool, device=document_ids.device)
    return mask.unsqueeze(1)
