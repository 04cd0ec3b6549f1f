"""Packed batches as documents: the boundaries every swapped attention keeps apart.

A packed row holds several documents (:class:`~lightning_speedkit.data.PackingCollate`).
While :func:`packed_documents` is active, every attention call of a swapped module whose
query and key are the packed rows (``(rows, heads, S, head_dim)``) runs per document:
each row is cut at the boundaries, the pieces of equal length are stacked, and each
stack is one SDPA call with the module's own causal flag. No token attends across a
boundary, and no ``S x S`` mask is ever built. Calls of another shape (a vision tower's
patches, a cross-attention's context) run as they are.

The boundaries stay set for the whole step (forward and backward), and the kit's
activation checkpointing replays them around its recomputation.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar, cast

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_speedkit import _surgery
from lightning_speedkit.attention._piece_kernels import without_cudnn
from lightning_speedkit.data._packed_fields import (
    HF_NAMES,
    ROW_FIELDS,
    carries_packing,
    cu_seqlens_values,
    packing_field,
    row_shaped,
)
from lightning_speedkit.errors import SpeedkitConfigError
from lightning_speedkit.measure._tensor_walk import named_containers

__all__ = ["Documents", "active", "documents_of", "packed_documents", "per_document"]

log = logging.getLogger(__name__)
_Fn = TypeVar("_Fn", bound=Callable[..., Any])

#: The batch fields that mark a packed batch (what PackingCollate returns).
PACKING_FIELDS = ("cu_seqlens", "document_ids")


@dataclass(frozen=True)
class Documents:
    """A packed batch's documents: for each row, the ``(start, end)`` spans covering it.

    Padding at a row's end is a span of its own: it attends to itself only.
    """

    rows: int
    length: int
    spans: tuple[tuple[tuple[int, int], ...], ...]
    _positions: Tensor | None = field(default=None, repr=False, compare=False)
    #: What a backend builds once per batch from the documents (FlexAttention's block mask).
    cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    #: What the batch met: ``"mixed"``, the class running attention over whole rows.
    seen: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def positions(self, device: torch.device) -> Tensor:
        """Each token's position in its document, ``(rows, S)``."""
        if self._positions is None:
            rows = [torch.cat([torch.arange(e - s) for s, e in spans]) for spans in self.spans]
            object.__setattr__(self, "_positions", torch.stack(rows))
        assert self._positions is not None
        return self._positions.to(device)

    def covers_rows(self, x: Tensor) -> bool:
        """Whether a module's ``(rows, S, ...)`` input is this batch's packed rows."""
        return x.ndim >= 2 and x.shape[0] == self.rows and x.shape[1] == self.length

    def covers(self, q: Tensor, k: Tensor, causal: bool = False) -> bool:
        """Whether an attention call's query and key are this batch's packed rows.

        A call over rows of the packed length whose batch is not the rows' count (heads
        folded into the batch, ``(rows * heads, 1, S, D)``) cannot be cut without knowing
        the fold's order, nor a causal call over the rows whose length is not the packed
        one (a prefix of image tokens): they run over whole rows, said once.
        """
        if q.ndim != 4 or k.ndim != 4:
            return False
        if q.shape[-2] != self.length:
            if causal and q.shape[0] == self.rows:
                warn_once(
                    f"A causal attention call over the batch's {self.rows} rows has "
                    f"{q.shape[-2]} tokens per row, not the packed {self.length} (tokens "
                    "added before the packed ones, an image prefix?): it attends across "
                    "documents. Pack the whole sequence the attention sees, or do not pack."
                )
            return False
        if q.shape[0] == self.rows and k.shape[-2] == self.length:
            return True
        if k.shape[-2] == self.length and q.shape[0] % self.rows == 0:
            warn_once(
                f"An attention call over rows of the packed length {self.length} has a batch "
                f"of {q.shape[0]}, not the batch's {self.rows} rows (heads folded into the "
                "batch?): it attends across documents. Keep the heads apart, (batch, heads, "
                "seq, dim), in that module, or do not pack."
            )
        return False


_ACTIVE: list[Documents | None] = [None]
"""The step's documents. A plain global, not thread-local: a backward on autograd's own
threads recomputes checkpointed blocks under the same boundaries."""


def active() -> Documents | None:
    """The documents attention keeps apart now, or None."""
    return _ACTIVE[0]


@contextlib.contextmanager
def _documents_set(documents: Documents | None) -> Iterator[None]:
    from lightning_speedkit.attention._own_calls import model_hooks  # it reads these documents

    previous = _ACTIVE[0]
    _ACTIVE[0] = documents
    if documents is not None:
        model_hooks()
    try:
        yield
    finally:
        _ACTIVE[0] = previous


def suspended() -> contextlib.AbstractContextManager[None]:
    """No documents inside: the parity check compares whole rows both ways."""
    return _documents_set(None)


@contextlib.contextmanager
def packed_documents(batch: Any) -> Iterator[Documents | None]:
    """Keep a packed batch's documents apart in every swapped attention, inside the block.

    ``batch`` is what :class:`~lightning_speedkit.data.PackingCollate` returned (a dict
    with ``cu_seqlens`` and/or ``document_ids``) or transformers'
    ``DataCollatorWithFlattening`` with ``return_seq_idx=True`` and/or
    ``return_flash_attn_kwargs=True``; a batch without them changes nothing. SDPA calls
    the model makes itself on the packed rows run per document too.
    :class:`~lightning_speedkit.AttentionSwap` does this for each training batch; use it
    without a Trainer, around forward *and* backward (an activation checkpoint recomputes
    in backward, under the same boundaries). Positions are the model's: pass the batch's
    ``position_ids`` to a model that takes them.

    Example::

        >>> import torch
        >>> from lightning_speedkit.data import PackingCollate
        >>> batch = PackingCollate(max_tokens=6)([{"input_ids": torch.tensor([1, 2, 3])},
        ...                                       {"input_ids": torch.tensor([4, 5])}])
        >>> with packed_documents(batch) as documents:
        ...     documents.spans
        (((0, 3), (3, 5), (5, 6)),)
    """
    with packed(batch, check=True) as documents:
        yield documents


@contextlib.contextmanager
def packed(batch: Any, *, check: bool) -> Iterator[Documents | None]:
    """:func:`packed_documents`; ``check``: warn once when attention in the block ran over
    whole rows (AttentionSwap says more itself: which modules, and why)."""
    from lightning_speedkit.attention._own_calls import warn_if_mixed

    documents = documents_of(batch)
    if documents is None:
        yield None
        return
    with _surgery.call_setting(partial(_documents_set, documents)):
        yield documents
    if check:
        warn_if_mixed(documents)


def documents_of(batch: Any) -> Documents | None:
    """A batch's documents, from its ``document_ids`` and/or ``cu_seqlens`` (or
    transformers' ``seq_idx`` and ``cu_seq_lens_q``); None if unpacked. Lists and arrays of
    integers are read as tensors (:mod:`lightning_speedkit.data._packed_fields`), never skipped.

    The fields are found wherever the batch holds them (``named_containers``): a dict or
    ``BatchEncoding``, a dataclass, a namedtuple, or one of these inside a list, a tuple or
    another of them. Two sets of fields that give different documents are refused.

    This reads the boundaries on the host: on a GPU, one device-to-host copy per batch.
    """
    containers = named_containers(batch)
    sets: dict[tuple[int, ...], tuple[str, Mapping[Any, Any]]] = {}
    for path, fields in containers:  # the very same fields reached twice are one set
        if carries_packing(fields):
            sets.setdefault(tuple(id(fields.get(k)) for k in _ALL_NAMES), (path, fields))
    if not sets:
        return None
    # The rows' fields where a set's own container lacks them: the outermost container's.
    rows = {
        f: c[f] for _, c in reversed(containers) for f in ROW_FIELDS if isinstance(c.get(f), Tensor)
    }
    found = [(path, _read(fields, {**rows, **fields})) for path, fields in sets.values()]
    (first, documents), *others = found
    for path, other in others:
        if other != documents:
            raise SpeedkitConfigError(
                f"The batch holds two different sets of packing fields (`cu_seqlens`/"
                f"`document_ids`), at `{first}` and at `{path}`, and the documents they give "
                f"differ; keep only the set the batch's rows were packed with (drop or rename "
                f"the other), so one set of documents is kept apart."
            )
    return documents


#: Every name a packing field goes by (ours and transformers').
_ALL_NAMES = tuple(name for pair in HF_NAMES.items() for name in pair)


def _read(fields: Mapping[Any, Any], view: Mapping[Any, Any]) -> Documents:
    """The documents of one set of packing ``fields``; ``view`` gives the rows' fields."""
    ids, cu = packing_field(fields, "document_ids"), packing_field(fields, "cu_seqlens")
    cu_list = cu_seqlens_values(cu) if cu is not None else None
    if ids is not None:
        return _from_document_ids(row_shaped(ids, view), cu_list)
    assert cu_list is not None  # one of the two is there
    rows = next((view[f] for f in ROW_FIELDS if isinstance(view.get(f), Tensor)), None)
    if rows is None or rows.ndim != 2:
        raise SpeedkitConfigError(
            f"`cu_seqlens` came without `document_ids` or a 2-D `input_ids`/`position_ids` "
            f"to say how long a row is (got {None if rows is None else tuple(rows.shape)}); "
            f"pass the batch PackingCollate returned, `document_ids` included."
        )
    return _from_cu_seqlens(cu_list, int(rows.shape[0]), int(rows.shape[1]))


def _from_document_ids(ids: Tensor, cu: list[int] | None) -> Documents:
    if ids.ndim == 1:
        ids = ids.unsqueeze(0)
    rows, length = int(ids.shape[0]), int(ids.shape[1])
    # Where a row changes document: one host read of the boundaries.
    changes = (ids[:, 1:] != ids[:, :-1]).nonzero().tolist()  # SYNC: once per batch
    starts: list[list[int]] = [[0] for _ in range(rows)]
    for row, before in changes:
        starts[row].append(before + 1)
    spans = tuple(
        tuple(zip(row_starts, [*row_starts[1:], length], strict=True)) for row_starts in starts
    )
    if cu is not None:
        # The runs of one id over the rows flattened, padding's (-1) left out: a document
        # that goes on into the next row is one, whatever the ids count from.
        flat = ids.reshape(-1)
        run_starts = torch.cat([flat.new_zeros(1), (flat[1:] != flat[:-1]).nonzero()[:, 0] + 1])
        run_ends = torch.cat([run_starts[1:], run_starts.new_full((1,), flat.numel())])
        lengths = (run_ends - run_starts)[flat[run_starts] >= 0].tolist()  # SYNC: with the above
        expected = [b - a for a, b in itertools.pairwise(cu)]
        if [n for n in lengths if n] != [n for n in expected if n]:
            raise SpeedkitConfigError(
                f"`cu_seqlens` and `document_ids` disagree: documents of {expected[:8]} tokens "
                f"in `cu_seqlens`, {lengths[:8]} in `document_ids`; build both with the same "
                f"PackingCollate call (or drop one of them)."
            )
    return Documents(rows, length, spans)


def _from_cu_seqlens(cu: list[int], rows: int, length: int) -> Documents:
    if cu[-1] != rows * length:
        raise SpeedkitConfigError(
            f"`cu_seqlens` must end at the {rows} x {length} = {rows * length} tokens of the "
            f"batch's rows, got {cu} (ending at {cu[-1]}); with padding in the rows pass "
            f"`document_ids` too "
            f"(PackingCollate returns it), else give `cu_seqlens` over the whole rows."
        )
    bounds = sorted(set(cu) | {r * length for r in range(rows + 1)})
    spans: list[list[tuple[int, int]]] = [[] for _ in range(rows)]
    for a, b in itertools.pairwise(bounds):
        spans[a // length].append((a % length, b - (a // length) * length))
    return Documents(rows, length, tuple(tuple(s) for s in spans))


def not_compiled(fn: _Fn) -> _Fn:
    """``torch.compiler.disable``: compiled, the call is a graph break and runs eagerly, so
    a compiled block's graph does not depend on the cuts (a new layout is no new graph)."""
    return cast("_Fn", torch.compiler.disable(fn))


@not_compiled
def per_document(
    run: Callable[..., Tensor],
    documents: Documents,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    **kwargs: Any,
) -> Tensor:
    """``run(q, k, v, attn_mask=..., **kwargs)`` on each document apart, as one output.

    Documents of equal length (in any row) go in one call; ``attn_mask`` (the model's
    own, over whole rows) is cut to each document's block.
    """
    mask = attn_mask
    if mask is not None:
        while mask.ndim < 4:
            mask = mask.unsqueeze(0)
    pieces: dict[tuple[int, int], Tensor] = {}
    _CUTTING[0] += 1  # the pieces' SDPA calls are not cut again by an enclosing mode
    try:
        with without_cudnn(q.device):  # a piece's new shape: no cuDNN plan built for it
            _cut(run, documents, q, k, v, mask, pieces, kwargs)
    finally:
        _CUTTING[0] -= 1
    return torch.stack(
        [
            torch.cat([pieces[(r, s)] for s, _ in spans], dim=-2)
            for r, spans in enumerate(documents.spans)
        ]
    )


_CUTTING = [0]  # how many per_document calls are running their pieces now


def _cut(
    run: Callable[..., Tensor],
    documents: Documents,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    pieces: dict[tuple[int, int], Tensor],
    kwargs: dict[str, Any],
) -> None:
    cut = {name: split_documents(t, documents) for name, t in (("q", q), ("k", k), ("v", v))}
    for members in groups(documents):

        def stack(name: str, members: list[tuple[int, int, int]] = members) -> Tensor:
            return torch.stack([cut[name][(r, s)] for r, s, _ in members])

        mask_g = None
        if mask is not None:
            mask_g = torch.stack(
                [mask[r if mask.shape[0] > 1 else 0, :, s:e, s:e] for r, s, e in members]
            )
        out = run(stack("q"), stack("k"), stack("v"), attn_mask=mask_g, **kwargs)
        for (r, s, _), piece in zip(members, out.unbind(0), strict=True):
            pieces[(r, s)] = piece


def split_documents(t: Tensor, documents: Documents) -> dict[tuple[int, int], Tensor]:
    """Each document's part of ``t`` (rows first, tokens at dim -2), by ``(row, start)``.

    Cut with one ``unbind`` and one ``split`` per row, not a slice per document: in
    backward a slice adds its gradient into a zero-filled copy of the whole tensor, once
    per document (measured 4x slower than this over 67 documents in 13 rows of 512),
    where ``split`` joins its pieces' gradients in one copy.
    """
    return {
        (r, s): piece
        for r, (row, spans) in enumerate(zip(t.unbind(0), documents.spans, strict=True))
        for (s, _), piece in zip(spans, row.split([e - s for s, e in spans], dim=-2), strict=True)
    }


def groups(documents: Documents) -> list[list[tuple[int, int, int]]]:
    """The documents as ``(row, start, end)``, grouped by length (one call per group)."""
    by_length: dict[int, list[tuple[int, int, int]]] = {}
    for row, spans in enumerate(documents.spans):
        for start, end in spans:
            by_length.setdefault(end - start, []).append((row, start, end))
    return list(by_length.values())


@contextlib.contextmanager
def sdpa_per_document() -> Iterator[None]:
    """Inside, SDPA on the packed rows runs per document while documents are active."""
    if active() is None or torch.compiler.is_compiling():
        yield
        return
    from lightning_speedkit.attention._own_calls import _SdpaPerDocument  # it cuts the calls

    with _SdpaPerDocument():
        yield


_WARNED: set[str] = set()


def warn_once(message: str, key: str | None = None) -> None:
    """Warn once per process per ``key`` (the message where none is given)."""
    key = message if key is None else key
    if key not in _WARNED:
        _WARNED.add(key)
        rank_zero_warn(message)


class StepDocuments:
    """A training step's documents, set from its batch until the step ends (AttentionSwap's).

    After the first packed step it says, once, which attention modules ran their own
    forward (reverted, skipped, or none found) without calling SDPA on the packed rows:
    those attended across documents.
    """

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self._packed = False
        self._warned = False
        self._warned_compiled = False

    def enter(self, batch: Any) -> None:
        """Set ``batch``'s documents (none if it is not packed) for the step."""
        self.exit()
        stack = contextlib.ExitStack()
        self._packed = stack.enter_context(packed(batch, check=False)) is not None
        self._stack = stack

    def exit(self, report: Any = None, model: nn.Module | None = None) -> None:
        """Clear the step's documents; with the swap's ``report`` on ``model``, warn about
        what mixed them (a module whose own SDPA calls ran per document did not)."""
        from lightning_speedkit.attention import _own_calls as own

        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
        compiled = own.compiled_outside_modules()  # cleared at every step
        if compiled and self._packed and model is not None and not self._warned_compiled:
            self._warned_compiled = True  # the model's modules are what they were: looked at once
            own.warn_compiled_outside(report, model)
        if report is not None and self._packed and not self._warned:
            self._warned = True
            own.warn_mixing(report, model)


def per_document_rows(
    run: Callable[[Tensor, Any, Any], tuple[Tensor, Any]],
    documents: Documents,
    x: Tensor,
    masks: Callable[[list[tuple[int, int, int]]], tuple[Any, Any]],
    *,
    batch_first: bool,
) -> tuple[Tensor, None]:
    """A module's whole call (``nn.MultiheadAttention``'s) on each group of documents apart.

    ``x`` is ``(rows, S, E)`` (``(S, rows, E)`` unless ``batch_first``); ``masks(group)``
    gives the call's masks cut to the group; ``run(x, attn_mask, key_padding_mask)``
    returns ``(output, weights)``.
    """
    cut = split_documents(x if batch_first else x.transpose(0, 1), documents)
    pieces: dict[tuple[int, int], Tensor] = {}
    for members in groups(documents):
        stacked = torch.stack([cut[(r, s)] for r, s, _ in members])
        with without_cudnn(x.device):
            out, _ = run(stacked if batch_first else stacked.transpose(0, 1), *masks(members))
        out = out if batch_first else out.transpose(0, 1)
        for (r, s, _), piece in zip(members, out.unbind(0), strict=True):
            pieces[(r, s)] = piece
    out = torch.stack(
        [
            torch.cat([pieces[(r, s)] for s, _ in spans], dim=0)
            for r, spans in enumerate(documents.spans)
        ]
    )
    return (out if batch_first else out.transpose(0, 1)), None
