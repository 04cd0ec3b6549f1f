"""What SpeedMonitor reads of a training batch: its shape signature, samples and tokens.

The signature and the samples are host metadata (shapes and dtypes, never values; but
see below for a packed batch without ``cu_seqlens``).
Tokens are counted twice: the token positions the step computed over (the largest 2-D
integer tensor's size, padding included: what the FLOP fit goes by) and the real tokens
(padding left out: what ``tokens_per_sec`` reports). Where the batch says which positions
are padding, a packed batch's ``document_ids`` or ``cu_seqlens`` (or transformers'
``seq_idx`` and ``cu_seq_lens_q``) or an ``attention_mask``, the real count is a 0-d
tensor reduced on the batch's device and read once per log interval, so reading a batch
still costs no device sync. A packed batch's samples are its documents: counted from the
shape of its ``cu_seqlens``, for free; a packed batch without one (transformers'
``DataCollatorWithFlattening`` by default: one row whose ``position_ids`` restart per
document) is counted from its values, one device read per step (pass
``return_flash_attn_kwargs=True`` to that collator to avoid it). A step of several train
loaders (Lightning's CombinedLoader) trains one batch of each: its samples and tokens are
summed over them. The packing fields are read as AttentionSwap reads them
(:mod:`lightning_speedkit.data._packed_fields`): lists and NumPy arrays too, and a
``(1, n)`` ``cu_seqlens`` (one row packed ahead of time, stacked by a ``DataLoader``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_speedkit.data._packed_fields import carries_packing, one_row_offsets, packing_field
from lightning_speedkit.errors import SpeedkitConfigError
from lightning_speedkit.measure import _tensor_walk


@dataclass(frozen=True)
class BatchInfo:
    """One training step's batch: shapes and dtypes of its tensors, samples, tokens."""

    signature: tuple[tuple[tuple[int, ...], str], ...]
    samples: int
    tokens: int | None
    real_tokens: int | torch.Tensor | None = field(default=None, compare=False)
    """Tokens that are not padding (a 0-d tensor on the batch's device when counted from
    its values); None: as ``tokens``."""
    first_packed: bool = field(default=False, compare=False)
    """The first batch the reader read that carries packing fields (``cu_seqlens``,
    ``document_ids``, or transformers' names): SpeedMonitor then checks, once, that
    attention keeps its documents apart."""

    @property
    def throughput_tokens(self) -> int | torch.Tensor | None:
        """The tokens ``tokens_per_sec`` counts: the real ones where known."""
        return self.tokens if self.real_tokens is None else self.real_tokens

    @cached_property
    def key(self) -> str:
        """The signature as a checkpoint-friendly string (computed once per batch)."""
        return repr(self.signature)


def number(value: Any, argument: str) -> float:
    """A user function's answer for one batch as a float, or the error that says what to return.

    Example::

        >>> number(torch.tensor(3), "tokens_per_batch")
        3.0
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu":
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpeedkitConfigError(
            f"`{argument}` must return a finite number for each batch, got {value!r} "
            f"({type(value).__name__}). Return a Python int or float, e.g. "
            f"`lambda batch: batch['input_ids'].numel()`."
        )
    if value < 0:
        raise SpeedkitConfigError(f"`{argument}` returned {value}; it must be 0 or more.")
    return float(value)


def _ids(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One loader's token tensor: its largest 2-D integer tensor (``input_ids``)."""
    ids = [t for t in tensors if t.ndim == 2 and not t.is_floating_point() and not t.is_complex()]
    return max(ids, key=lambda t: t.numel(), default=None)


def _offsets(batch: Mapping[Any, Any]) -> torch.Tensor | None:
    """A packed batch's ``cu_seqlens`` as 1-D offsets (a ``(1, n)`` stack of one row's is
    its ``n``), as AttentionSwap reads them; None when absent or of another shape."""
    cu = packing_field(batch, "cu_seqlens")
    if cu is None:
        return None
    cu = one_row_offsets(cu)
    return cu if cu.ndim == 1 and cu.numel() else None


def _counted_documents(batch: Mapping[Any, Any], ids: torch.Tensor | None) -> int | None:
    """A packed batch's documents counted from its values (no ``cu_seqlens`` to count them
    from its shape): where ``document_ids`` start a document (-1 is padding), else where the
    ``position_ids`` of one flattened row restart; None when neither says."""
    documents = packing_field(batch, "document_ids")
    if documents is not None and documents.ndim in (1, 2) and documents.numel():
        rows = documents.reshape(-1, documents.shape[-1])
        starts = (rows[:, 1:] != rows[:, :-1]) & (rows[:, 1:] >= 0)
        # SYNC: the documents' starts, read on the host (a batch without `cu_seqlens`)
        return int(starts.sum() + (rows[:, 0] >= 0).sum())
    positions = batch.get("position_ids")
    if (
        isinstance(positions, torch.Tensor)
        and ids is not None
        and positions.shape == ids.shape
        and positions.shape[0] == 1
    ):
        # SYNC: a document starts where the positions do not grow, read on the host
        return int((positions[:, 1:] <= positions[:, :-1]).sum()) + 1
    return None


def tokens(tensors: list[torch.Tensor]) -> int | None:
    """Token positions of one loader's batch: its largest 2-D integer tensor's size."""
    ids = _ids(tensors)
    return None if ids is None else ids.numel()


def real_tokens(batch: Any, tensors: list[torch.Tensor]) -> int | torch.Tensor | None:
    """Tokens of one loader's batch that are not padding, where the batch says which are.

    In this order: a packed batch's ``document_ids`` (tokens of document 0 or more: -1
    is PackingCollate's padding; with an ``attention_mask`` of the same shape, only its
    nonzero entries: samples packed with their own padding), its ``cu_seqlens`` (the
    tokens its documents cover),
    each also under transformers' name (``seq_idx``, ``cu_seq_lens_q``), an
    ``attention_mask`` shaped as the tokens (its nonzero entries); else every token
    position (a flattened row with ``position_ids`` only has no padding). Labels are not
    read: -100 marks a token the loss ignores (a prompt), which the model still ran.
    Device reductions, never read here (no sync).

    Example::

        >>> ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
        >>> int(real_tokens({"input_ids": ids, "attention_mask": (ids > 0).long()}, [ids]))
        5
    """
    return _real_tokens(_fields(batch), tensors)


def _real_tokens(
    fields: Mapping[Any, Any] | None, tensors: list[torch.Tensor]
) -> int | torch.Tensor | None:
    """:func:`real_tokens` of a batch whose fields (:func:`_fields`) are read already."""
    ids = _ids(tensors)
    if fields is not None:
        documents, cu = packing_field(fields, "document_ids"), _offsets(fields)
        mask = fields.get("attention_mask")
        if documents is not None and documents.ndim in (1, 2):
            if isinstance(mask, torch.Tensor) and mask.shape == documents.shape:
                return ((documents >= 0) & (mask != 0)).sum()  # samples packed with their pads
            return (documents >= 0).sum()
        if cu is not None:
            return cu[-1] - cu[0]
        if isinstance(mask, torch.Tensor) and ids is not None and mask.shape == ids.shape:
            return (mask != 0).sum()
    return None if ids is None else ids.numel()


def _fields(batch: Any) -> Mapping[Any, Any] | None:
    """One loader's batch's fields by name (a dict, a namedtuple, a dataclass): the first
    container in it that carries packing fields, at any depth (``(ids, labels, {"cu_seqlens":
    ...})``, ``{"inputs": packed}``), as AttentionSwap finds them; else its own, or None."""
    containers = _tensor_walk.named_containers(batch)
    packed = next((fields for _, fields in containers if carries_packing(fields)), None)
    return packed if packed is not None else _tensor_walk.named_fields(batch)


class BatchReader:
    """Reads :class:`BatchInfo` from batches, with the user's functions where given.

    Args:
        samples_per_batch: ``batch -> samples``; by default the first dimension of each
            loader's first tensor (a packed batch's: its documents, ``len(cu_seqlens) - 1``).
            A batch with no tensor counts as one sample, said once.
        tokens_per_batch: ``batch -> tokens``, for the FLOP fit and ``tokens_per_sec``
            alike; by default each loader's largest 2-D integer tensor, summed (None when
            there is none), and for ``tokens_per_sec`` only its real tokens
            (:func:`real_tokens`).

    Example::

        >>> reader = BatchReader()
        >>> batch = {"input_ids": torch.zeros(4, 16, dtype=torch.long)}
        >>> info = reader.read(batch, [batch])
        >>> info.samples, info.tokens
        (4, 64)

        A packed batch counts its documents as samples and its real tokens apart:

        >>> from lightning_speedkit.data import PackingCollate
        >>> packed = PackingCollate(max_tokens=4)([{"input_ids": [1, 2, 3]},
        ...                                       {"input_ids": [4, 5]}])
        >>> info = reader.read(packed, [packed])
        >>> info.samples, info.tokens, int(info.real_tokens)
        (2, 8, 5)
    """

    def __init__(
        self,
        samples_per_batch: Callable[[Any], int] | None = None,
        tokens_per_batch: Callable[[Any], int] | None = None,
    ) -> None:
        self.samples_per_batch = samples_per_batch
        self.tokens_per_batch = tokens_per_batch
        self._said_samples = False
        self._seen_packed = False

    def read(self, batch: Any, parts: Sequence[Any]) -> BatchInfo:
        """``batch``'s info; ``parts`` are its loaders' batches (``[batch]`` for one loader)."""
        tensors = [list(_tensor_walk.tensors(part)) for part in parts]
        named = [_fields(part) for part in parts]  # one walk of each part
        signature = tuple((tuple(t.shape), str(t.dtype)) for each in tensors for t in each)
        packed = any(fields is not None and carries_packing(fields) for fields in named)
        first_packed = not self._seen_packed and packed
        self._seen_packed = self._seen_packed or first_packed
        if self.samples_per_batch is not None:
            samples = int(number(self.samples_per_batch(batch), "samples_per_batch"))
        else:
            samples = sum(
                self._samples(part, found, fields)
                for part, found, fields in zip(parts, tensors, named, strict=True)
            )
        if self.tokens_per_batch is not None:
            count = int(number(self.tokens_per_batch(batch), "tokens_per_batch"))
            return BatchInfo(signature, samples, count, first_packed=first_packed)
        counts = [n for found in tensors if (n := tokens(found)) is not None]
        reals = [
            r
            for found, fields in zip(tensors, named, strict=True)
            if (r := _real_tokens(fields, found)) is not None
        ]
        real: int | torch.Tensor | None = None
        for each in reals:
            real = each if real is None else real + each
        positions = sum(counts) if counts else None
        return BatchInfo(signature, samples, positions, real, first_packed=first_packed)

    def _samples(
        self, batch: Any, tensors: list[torch.Tensor], fields: Mapping[Any, Any] | None
    ) -> int:
        """Samples of one loader's batch (its :func:`_fields`): a packed batch's documents
        (its ``cu_seqlens`` has one entry more; else :func:`_counted_documents`), else the
        first dimension of its first tensor."""
        if fields is not None:
            cu = _offsets(fields)
            if cu is not None:
                return int(cu.shape[0]) - 1
            documents = _counted_documents(fields, _ids(tensors))
            if documents is not None:
                return documents
        if tensors and tensors[0].ndim:
            return int(tensors[0].shape[0])
        if fields is None and not isinstance(batch, (list, tuple, str)):
            with contextlib.suppress(TypeError):  # an object of one's own: its own length
                samples = len(batch)
                if not self._said_samples:
                    self._said_samples = True
                    rank_zero_info(
                        f"SpeedMonitor counts the samples of a batch of type "
                        f"`{type(batch).__name__}` by its len() ({samples}); pass "
                        f"`SpeedMonitor(samples_per_batch=lambda batch: ...)` if that is not "
                        f"its sample count."
                    )
                return samples
        if not self._said_samples:
            self._said_samples = True
            found = "holds no tensor" if not tensors else "starts with a 0-d tensor"
            rank_zero_warn(
                f"SpeedMonitor cannot tell how many samples a batch of type "
                f"`{type(batch).__name__}` holds (it {found}), so it counts one per batch: "
                f"samples/s and FLOPs per sample are off by the batch size. Pass "
                f"`SpeedMonitor(samples_per_batch=lambda batch: ...)`."
            )
        return 1
