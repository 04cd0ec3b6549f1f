"""Sequence packing: several samples per row, with the boundaries that keep them apart."""

from __future__ import annotations

import functools
import numbers
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_speedkit import _validation
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["TOKEN_FIELDS", "PackingCollate", "document_mask"]

#: A tokenizer's fields of one value per token, which :class:`PackingCollate` packs with
#: the tokens by default.
TOKEN_FIELDS = ("labels", "attention_mask", "token_type_ids", "special_tokens_mask")


def _numeric_numpy(value: Any) -> bool:
    """Whether ``value`` is a NumPy array or number of numbers (booleans included), which
    ``default_collate`` makes a tensor (NumPy is looked up only where it is imported)."""
    numpy = sys.modules.get("numpy")
    numeric = isinstance(value, (numpy.ndarray, numpy.generic)) if numpy is not None else False
    return numeric and value.dtype.kind in "biufc"


class PackingCollate:
    """Packs variable-length samples into rows of ``max_tokens`` instead of padding each one.

    Samples are placed greedily, in order, into the current row until the next one
    does not fit, then a new row starts; the end of the last row is padded. A
    sample longer than ``max_tokens`` is cut to it (said once). The batch carries what an
    attention kernel needs to keep documents apart:

    - ``cu_seqlens`` (int32, ``[0, len0, len0+len1, ...]``) over the flattened rows,
      padding excluded: flash-attn's ``varlen`` layout;
    - ``position_ids``: restart at 0 in every document;
    - ``document_ids``: the document index of each token, ``-1`` on padding (for
      FlexAttention's document mask, or :func:`document_mask`);
    - ``max_seqlen``: the longest document, as a Python int.

    The samples' other fields are kept, none dropped (a field some samples lack is
    ``None`` for them):

    - the per-token fields named in ``token_fields`` (by default a tokenizer's
      ``labels``, ``attention_mask``, ``token_type_ids`` and ``special_tokens_mask``),
      each as long as the tokens in every sample (a tensor, an array or a list), are
      packed with the tokens, into the same rows and places; their padding is
      ``pad_values[field]``, by default -100 for ``labels`` (the loss's ignore index in
      torch and Hugging Face) and 0 for the others;
    - other tensors and NumPy arrays (an image, a class label) are stacked in document
      order, and numbers (NumPy's too) become a tensor of one per document, as
      ``default_collate`` makes them;
    - anything else (strings, ids) is a list in document order.

    Which fields are packed goes by name, not by length, so a field's shape never
    changes from one batch to the next.

    Hugging Face's causal LMs shift ``labels`` inside the model, so a packed row's
    loss also asks each document's last token for the next document's first. With
    ``separate_documents=True`` no loss does: each document's first label becomes -100
    (the loss's ignore index), as transformers' ``DataCollatorWithFlattening`` does, and
    the shifted loss pairs each document's last token with nothing.

    Each sample holds one sequence: its tokens 1-D, ``(N,)``. A ``(1, N)`` tensor, as a
    tokenizer called with ``return_tensors="pt"`` gives every field, is taken as its N
    tokens (its per-token fields likewise); a ``(B, N)`` batch is refused with the fix.

    Args:
        max_tokens: tokens per packed row.
        key: the sample field holding the token sequence.
        pad_id: the value padding positions get.
        pad_values: the padding of per-token fields, by field name.
        token_fields: the fields holding one value per token, packed with the tokens.
        separate_documents: set each document's first ``labels`` value to -100, so that
            a loss shifting labels (Hugging Face's causal LMs) never asks a document's
            last token for the next document's first. Needs ``labels`` in the samples.
        first_fit: place the samples longest first, each into the first row with room
            (first-fit decreasing), instead of in the order given: fewer rows and less
            padding (on long-tailed lengths, 6% padding against 21% in order:
            ``benchmarks/packing.py``). The batch's documents then come in the order
            placed (``cu_seqlens``, ``document_ids`` and the stacked fields agree).

    Example::

        >>> collate = PackingCollate(max_tokens=6)
        >>> batch = collate([{"input_ids": torch.tensor([1, 2, 3])},
        ...                  {"input_ids": torch.tensor([4, 5])},
        ...                  {"input_ids": torch.tensor([6, 7, 8, 9])}])
        >>> batch["input_ids"].tolist()
        [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]]
        >>> batch["cu_seqlens"].tolist(), batch["document_ids"][0].tolist()
        ([0, 3, 5, 9], [0, 0, 0, 1, 1, -1])

        A Hugging Face tokenizer's output, with labels, packs field by field:

        >>> batch = PackingCollate(max_tokens=4)([
        ...     {"input_ids": [1, 2], "attention_mask": [1, 1], "labels": [1, 2]},
        ...     {"input_ids": [3], "attention_mask": [1], "labels": [3]}])
        >>> batch["labels"].tolist(), batch["attention_mask"].tolist()
        ([[1, 2, 3, -100]], [[1, 1, 1, 0]])

        With ``separate_documents=True`` no shifted label crosses into the next document:

        >>> PackingCollate(max_tokens=4, separate_documents=True)([
        ...     {"input_ids": [1, 2], "labels": [1, 2]},
        ...     {"input_ids": [3], "labels": [3]}])["labels"].tolist()
        [[-100, 2, -100, -100]]
    """

    def __init__(
        self,
        max_tokens: int,
        key: str = "input_ids",
        pad_id: int = 0,
        pad_values: Mapping[str, int | float] | None = None,
        token_fields: Sequence[str] = TOKEN_FIELDS,
        separate_documents: bool = False,
        first_fit: bool = False,
    ) -> None:
        self.max_tokens = _validation.positive_int("max_tokens", max_tokens, example=2048)
        self.key = _validation.text("key", key, example="input_ids")
        self.pad_id = _validation.integer("pad_id", pad_id, example=0)
        if pad_values is not None and not isinstance(pad_values, Mapping):
            raise SpeedkitConfigError(
                f"`pad_values` must map field names to padding values, e.g. "
                f"{{'labels': -100}}; got {pad_values!r}."
            )
        given: Mapping[str, Any] = pad_values or {}  # as typed, or not: it is checked here
        for field, value in given.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                _validation.fail(f"pad_values[{field!r}]", value, "must be a number",
                                 "pass e.g. `pad_values={'labels': -100}`")  # fmt: skip
        if isinstance(token_fields, str) or not all(isinstance(f, str) for f in token_fields):
            raise SpeedkitConfigError(
                f"`token_fields` must be a list of field names, e.g. ['labels']; got "
                f"{token_fields!r}."
            )
        self.pad_values = {"labels": -100, **(pad_values or {})}
        self.token_fields = tuple(token_fields)
        if not isinstance(separate_documents, bool):
            raise SpeedkitConfigError(
                f"`separate_documents` must be True or False, got {separate_documents!r}."
            )
        self.separate_documents = separate_documents
        if not isinstance(first_fit, bool):
            raise SpeedkitConfigError(f"`first_fit` must be True or False, got {first_fit!r}.")
        self.first_fit = first_fit
        self._warned_cut = self._warned_padded = False
        self._checked_labels = False

    def __call__(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        if not samples:
            raise SpeedkitConfigError("PackingCollate got an empty list of samples.")
        tokens: list[Tensor] = []
        for sample in samples:
            if not isinstance(sample, Mapping) or self.key not in sample:
                found = sorted(sample) if isinstance(sample, Mapping) else type(sample).__name__
                raise SpeedkitConfigError(
                    f"PackingCollate(key={self.key!r}) found no {self.key!r} in a sample "
                    f"({found}); samples must be dicts, and `key` the field holding the tokens."
                )
            tokens.append(self._sequence(len(tokens), sample[self.key]))
        samples, tokens = self._unpadded(samples, tokens)
        if self.first_fit:
            lengths = [min(len(seq), self.max_tokens) for seq in tokens]
            order = first_fit_decreasing(lengths, self.max_tokens)
            samples, tokens = [samples[i] for i in order], [tokens[i] for i in order]
        # Where each document goes: (row, offset, kept length), greedily in order.
        places: list[tuple[int, int, int]] = []
        row, used = 0, 0
        longest = max(len(seq) for seq in tokens)
        if longest > self.max_tokens and not self._warned_cut:
            self._warned_cut = True
            rank_zero_warn(
                f"PackingCollate(max_tokens={self.max_tokens}) cut a sample of {longest} "
                f"tokens to {self.max_tokens} (its last {longest - self.max_tokens} are not "
                f"trained on); raise `max_tokens`, or split long samples before packing."
            )
        for seq in tokens:
            n = min(len(seq), self.max_tokens)
            if used + n > self.max_tokens:
                row, used = row + 1, 0
            places.append((row, used, n))
            used += n
        n_rows = row + 1
        positions = torch.zeros((n_rows, self.max_tokens), dtype=torch.long)
        documents = torch.full((n_rows, self.max_tokens), -1, dtype=torch.long)
        for doc, (r, offset, n) in enumerate(places):
            positions[r, offset : offset + n] = torch.arange(n)
            documents[r, offset : offset + n] = doc
        lengths = [n for _, _, n in places]
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
        batch: dict[str, Any] = {
            self.key: self._pack(tokens, places, n_rows, self.pad_id),
            "position_ids": positions,
            "document_ids": documents,
            "cu_seqlens": cu,
            "max_seqlen": max(lengths),
        }
        fields = dict.fromkeys(field for sample in samples for field in sample)
        for field in fields:
            if field == self.key or field in batch:
                continue
            values = [sample.get(field) for sample in samples]
            if field in self.token_fields:
                batch[field] = self._pack(self._per_token(field, values, tokens), places,
                                          n_rows, self.pad_values.get(field, 0))  # fmt: skip
            elif all(isinstance(v, Tensor) or _numeric_numpy(v) for v in values):
                # As default_collate: tensors and NumPy arrays stacked, NumPy numbers (0-d)
                # made a tensor of one per document, NumPy's dtype kept.
                try:
                    batch[field] = torch.stack([torch.as_tensor(v) for v in values])
                except RuntimeError as exc:
                    raise SpeedkitConfigError(
                        f"PackingCollate cannot stack the samples' {field!r} ({exc}): name "
                        f"it in `token_fields` if it holds one value per token, or pad or "
                        f"drop it before packing."
                    ) from None
            elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                batch[field] = torch.tensor(values)
            else:
                batch[field] = values
        if not self._checked_labels:
            self._checked_labels = _check_labels(samples, tokens, self.key, self.separate_documents)
        if self.separate_documents:
            self._separate(batch, places)
        return batch

    def _unpadded(
        self, samples: Sequence[dict[str, Any]], tokens: list[Tensor]
    ) -> tuple[Sequence[dict[str, Any]], list[Tensor]]:
        """The samples without the padding their ``attention_mask`` marks (a tokenizer
        called with ``padding="max_length"``), per-token fields cut alike: packing is what
        removes padding, and a pad inside a row would be trained on as a token."""
        if "attention_mask" not in self.token_fields:
            return samples, tokens
        out_samples, out_tokens, dropped = list(samples), list(tokens), 0
        for i, (sample, seq) in enumerate(zip(samples, tokens, strict=True)):
            mask = sample.get("attention_mask")
            keep = torch.as_tensor(mask).reshape(-1) != 0 if mask is not None else None
            if keep is None or keep.shape != seq.shape or bool(keep.all()):
                continue
            fields = [f for f in self.token_fields if sample.get(f) is not None]
            cut = {f: self._per_token(f, [sample[f]], [seq])[0][keep] for f in fields}
            out_samples[i], out_tokens[i] = {**sample, self.key: seq[keep], **cut}, seq[keep]
            dropped += int((~keep).sum())
        if dropped and not self._warned_padded:
            self._warned_padded = True
            rank_zero_warn(
                f"PackingCollate: samples came padded ({dropped} tokens of this batch have "
                f"attention_mask 0); their padding is left out of the packed rows. Tokenize "
                f"without padding (`padding=False`) before packing."
            )
        return out_samples, out_tokens

    def _separate(self, batch: dict[str, Any], places: list[tuple[int, int, int]]) -> None:
        labels = batch.get("labels")
        if not isinstance(labels, Tensor) or labels.shape != batch[self.key].shape:
            raise SpeedkitConfigError(
                f"`separate_documents=True` sets each document's first label to -100, but the "
                f"samples carry no per-token 'labels' (got {type(labels).__name__}); add "
                f"labels to the samples (a copy of {self.key!r} for a causal LM), or pass "
                f"`separate_documents=False`."
            )
        for r, offset, n in places:
            if n:
                labels[r, offset] = -100

    def _sequence(self, index: int, value: Any) -> Tensor:
        """Sample ``index``'s tokens as one 1-D sequence: a (1, N) tensor (a tokenizer's
        ``return_tensors="pt"``) is its N tokens; a (B, N) batch or a scalar is refused."""
        tokens = torch.as_tensor(value)
        if tokens.numel() == 0 and tokens.is_floating_point():  # `[]`: no tokens, no dtype
            tokens = tokens.long()
        if tokens.ndim == 2 and tokens.shape[0] == 1:
            return tokens[0]
        if tokens.ndim != 1:
            raise SpeedkitConfigError(
                f"PackingCollate packs one sequence per sample, but sample {index}'s "
                f"{self.key!r} has shape {tuple(tokens.shape)}; a sample's tokens must be 1-D "
                f"(N,) or (1, N). Give the DataLoader one sequence per dataset item (a batch "
                f"of B sequences is B samples), and let PackingCollate batch them."
            )
        return tokens

    def _per_token(self, field: str, values: list[Any], tokens: list[Tensor]) -> list[Tensor]:
        """A per-token field's values as 1-D tensors, each as long as its tokens ((1, N)
        taken as N values, as the tokens are)."""
        per_doc = []
        for value, seq in zip(values, tokens, strict=True):
            tensor = torch.as_tensor(value) if value is not None else None
            if tensor is not None and tensor.ndim == 2 and tensor.shape[0] == 1:
                tensor = tensor[0]
            if tensor is None or tensor.ndim != 1 or len(tensor) != len(seq):
                got = "nothing" if tensor is None else f"shape {tuple(tensor.shape)}"
                raise SpeedkitConfigError(
                    f"PackingCollate packs {field!r} with the tokens (`token_fields`), but a "
                    f"sample's is {got} where its {self.key!r} has {len(seq)} tokens; give "
                    f"one value per token, or leave {field!r} out of `token_fields`."
                )
            per_doc.append(tensor)
        # An empty sample's `[]` comes as float32: it takes the field's dtype from the others
        # (else one empty sample would turn the batch's labels into floats).
        dtype = next((t.dtype for t in per_doc if t.numel()), per_doc[0].dtype)
        return [t.to(dtype) if not t.numel() else t for t in per_doc]

    def _pack(
        self,
        per_doc: list[Tensor],
        places: list[tuple[int, int, int]],
        n_rows: int,
        pad: int | float,
    ) -> Tensor:
        dtype = functools.reduce(torch.promote_types, (seq.dtype for seq in per_doc))
        if isinstance(pad, float) and not dtype.is_floating_point:
            dtype = torch.promote_types(dtype, torch.get_default_dtype())
        elif pad < 0 and not torch.empty((), dtype=dtype).is_signed():
            dtype = torch.int64  # -100 in uint8 labels would wrap to 156
        out = torch.full((n_rows, self.max_tokens), pad, dtype=dtype)
        for seq, (r, offset, n) in zip(per_doc, places, strict=True):
            out[r, offset : offset + n] = seq[:n]
        return out


def _check_labels(
    samples: Sequence[Mapping[str, Any]], tokens: list[Tensor], key: str, separate: bool
) -> bool:
    """Warn once when ``separate_documents`` does not fit the samples' labels.

    Labels equal to the tokens (where not -100) are Hugging Face's causal-LM convention
    (the model shifts them): without ``separate_documents`` each document's last token is
    asked for the next one's first. Labels equal to the tokens shifted left by one were
    shifted already: no pair crosses a document, and ``separate_documents`` would drop
    each document's first real target. Returns whether the labels could be judged.
    """
    labels = [sample.get("labels") for sample in samples]
    if any(value is None for value in labels):
        return False
    try:
        labels_t = [torch.as_tensor(value).reshape(-1) for value in labels]
    except (TypeError, ValueError, RuntimeError):
        return True
    pairs = list(zip(labels_t, tokens, strict=True))
    if any(len(lab) != len(tok) for lab, tok in pairs) or all(len(tok) < 2 for tok in tokens):
        return True
    # Where a label is the loss's ignore index (a masked prompt), it says nothing.
    same = all(torch.equal(lab[lab != -100], tok[lab != -100]) for lab, tok in pairs)
    shifted = all(
        torch.equal(lab[:-1][lab[:-1] != -100], tok[1:][lab[:-1] != -100]) for lab, tok in pairs
    )
    if not any(bool((lab != -100).any()) for lab, _ in pairs):
        return True
    if same and not separate:
        rank_zero_warn(
            f"PackingCollate: the samples' 'labels' equal their {key!r}; a model that shifts "
            f"labels inside (Hugging Face's causal LMs) then asks each document's last token "
            f"for the next document's first, and the loss is not the documents' own: pass "
            f"`separate_documents=True` (a model that does not shift labels, a masked LM, "
            f"can ignore this)."
        )
    elif shifted and not same and separate:
        rank_zero_warn(
            f"PackingCollate(separate_documents=True): the samples' 'labels' are their "
            f"{key!r} shifted left by one already, so no label pairs across documents, and "
            f"setting each document's first label to -100 drops a real target. Pass "
            f"`separate_documents=False`."
        )
    return True


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[int]:
    """An order of ``lengths`` in which filling rows of ``capacity`` greedily, starting a
    new row when the next does not fit, gives the rows of first-fit-decreasing packing.

    Each length, longest first, goes into the first row with room; the rows' members,
    row after row, are the order. (A row's room only shrinks, so a length that opened a
    row did not fit in the rows before it, and the greedy pass opens a row there too.)

    Example::

        >>> first_fit_decreasing([5, 2, 4, 1], capacity=6)
        [0, 3, 2, 1]
    """
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if row is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        rows[row].append(i)
        room[row] -= lengths[i]
    return [i for row in rows for i in row]


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
