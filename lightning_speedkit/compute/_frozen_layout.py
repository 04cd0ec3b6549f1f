"""Which sample each row of a cached module's input is, as far as the batch shows it.

A stored feature is filed under its sample's key: row ``i`` of the module's output under
the batch's ``i``-th key. That is right only when row ``i`` of its input is sample ``i``.
A batch can hold as many rows as samples and still not be laid out so: Hugging Face
Llava's multi-image ``pixel_values`` concatenates every image of the batch (a text-only
sample gives none, another two), and Idefics3 gives its tower
``pixel_values.view(B * N, ...)[real_images]``; a batch of image counts ``[2, 0]`` has two
rows for two keys, the second of them the first sample's second image.

With ``key="index"`` the loader's collate wrapper sees each sample's values before they
are collated and notes, per batch field, how its rows came from them (:func:`layout`),
and each call is checked before anything is stored or served (:func:`why_not_rows`). A
call on a batch field as it is is served when that field has one row per sample (the
samples' values stacked, padded or not, or one row of each concatenated), and refused
when it was concatenated from samples of other row counts. A field the collate_fn built
from values of another name or kind (a processor or tokenizer called in it, a renamed
field) is refused when the samples hold something in a varying number that could be its
rows (a list of images of varying length), else served. A call on an input made in the
model is refused when a batch field's samples hold varying numbers of rows shaped as its
rows (images, not samples); one of a number per row (labels cast in the model) never is,
as an image is never a number. Without the collate wrapper (no Trainer, ``key="<field>"``)
the keys say which sample each row is; what the batch's shapes show is still checked.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Number
from typing import Any

import torch

__all__ = [
    "NO_ROW",
    "ROWS_UNCHECKED",
    "FieldLayout",
    "batch_fields",
    "layout",
    "loader_keeps_inputs",
    "no_row_per_sample",
    "why_not_rows",
]

#: Words every "no row per sample" reason holds: said once per module, whatever the shape.
NO_ROW = "has no row per sample"
#: What a mismatch on a call whose rows could not be checked may come from, first.
ROWS_UNCHECKED = (
    "its input's rows not being one per key (a batch of a varying number of images per "
    "sample, as Hugging Face Llava's multi-image `pixel_values` or Idefics3's real images, "
    "stores one sample's image under another's key: key each image instead), "
)
_FIX = (
    'Cache a module whose input has one row per sample, or key each row: `key="<field>"` '
    "naming a batch field with one id per row of its input, in its order (without a "
    "Trainer, `cache.keys(...)` with one key per row)"
)


@dataclass(frozen=True)
class FieldLayout:
    """A batch field as the collate_fn made it from the samples.

    ``samples``: each sample's shape of the value of the same name or place (None where
    one has none or no such value). ``counts``: the rows each sample gave the field, told
    from those shapes (all ones when row ``i`` is sample ``i``), or None when they do not
    tell. ``varying``: then, what in the samples comes in a varying number (a list of
    images of varying length) and could give it a varying number of rows per sample."""

    shape: tuple[int, ...]
    samples: tuple[tuple[int, ...], ...] | None
    counts: tuple[int, ...] | None = None
    varying: str | None = None


def batch_fields(batch: Any) -> dict[Hashable, torch.Tensor]:
    """A batch's tensors by field: a dict's keys, a list's or tuple's positions."""
    if isinstance(batch, Mapping):
        return {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if isinstance(batch, (list, tuple)):
        return {i: v for i, v in enumerate(batch) if isinstance(v, torch.Tensor)}
    return {}


def _shape(value: Any) -> tuple[int, ...] | None:
    """A tensor's or array's shape, ``()`` for a number, ``(n,)`` for a list of numbers
    (token ids); None for anything else (an image file, a string, a list of images)."""
    if isinstance(value, Number):
        return ()
    shape = getattr(value, "shape", None)  # a tensor, a NumPy array
    if isinstance(shape, (tuple, torch.Size)):
        return tuple(int(s) for s in shape)
    if isinstance(value, (list, tuple)) and all(isinstance(v, Number) for v in value):
        return (len(value),)
    return None


def _value(item: Any, field: Hashable) -> Any:
    if isinstance(item, Mapping):
        return item.get(field)
    if isinstance(item, (list, tuple)) and isinstance(field, int) and 0 <= field < len(item):
        return item[field]
    return None


def _names(item: Any) -> list[Hashable]:
    if isinstance(item, Mapping):
        return list(item)
    return list(range(len(item))) if isinstance(item, (list, tuple)) else []


def layout(items: Sequence[Any], batch: Any) -> dict[Hashable, FieldLayout]:
    """How each tensor field of ``batch`` came from ``items``, the samples it was
    collated from (the loader's collate wrapper calls it on every batch).

    Example::

        >>> items = [{"x": torch.zeros(2, 3)}, {"x": torch.zeros(0, 3)}]
        >>> layout(items, {"x": torch.zeros(2, 3)})["x"].counts  # concatenated
        (2, 0)
        >>> items = [{"x": torch.zeros(3)}, {"x": torch.zeros(3)}]
        >>> layout(items, {"x": torch.zeros(2, 3)})["x"].counts  # stacked
        (1, 1)
        >>> items = [{"images": ["a.jpg", "b.jpg"]}, {"images": []}]
        >>> layout(items, {"pixels": torch.zeros(2, 3)})["pixels"].varying  # built
        '`images` holds 2, 0'
    """
    found = {}
    for field, tensor in batch_fields(batch).items():
        shape = tuple(tensor.shape)
        shapes = [_shape(_value(item, field)) for item in items]
        known = tuple(shapes) if all(s is not None for s in shapes) else None
        counts = _counts(shape, known) if known is not None else None  # type: ignore[arg-type]
        varying = _varying(items, shape) if counts is None else None
        found[field] = FieldLayout(shape, known, counts, varying)  # type: ignore[arg-type]
    return found


def _counts(shape: tuple[int, ...], shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...] | None:
    """The rows each sample of ``shapes`` gave a field of ``shape``: one each when stacked
    (padded or not), each one's own count when concatenated; None when neither."""
    if not shape:
        return None
    if shape[0] == len(shapes) and all(len(s) + 1 == len(shape) for s in shapes):
        return (1,) * len(shapes)
    if all(len(s) == len(shape) for s in shapes) and sum(s[0] for s in shapes) == shape[0]:
        return tuple(s[0] for s in shapes)
    return None


def _varying(items: Sequence[Any], shape: tuple[int, ...]) -> str | None:
    """What in ``items`` comes in a varying number and could be rows of a field of
    ``shape`` the collate_fn built: values shaped as a count of its rows, or lists of
    other things (images, captions), of counts that differ between samples."""
    rows = shape[1:]
    for name in _names(items[0]) if items else []:
        counts: list[int] = []
        for item in items:
            value = _value(item, name)
            held = _shape(value)
            if isinstance(value, (list, tuple)) and (not value or held is None):
                counts.append(len(value))  # images, captions (not token ids), or none
            elif held is not None and len(held) == len(rows) + 1 and held[1:] == rows:
                counts.append(held[0])
            else:
                break
        if len(counts) == len(items) and len(set(counts)) > 1:
            return f"`{name}` holds {_shown(tuple(counts))}"
    return None


def why_not_rows(
    source: Hashable | None,
    inputs: Sequence[Any],
    fields: Mapping[Hashable, torch.Tensor],
    layouts: Mapping[Hashable, FieldLayout] | None,
    samples: int,
    of: str = "the batch's",
) -> str | None:
    """Why the rows of a call's input may not be the batch's samples, in order; None when
    nothing the batch shows says so. ``source``: the batch field the call reads as it is
    (None: an input made in the model); ``layouts``: the collate's (None without it);
    ``of``: what ``fields`` are, in words (the batch's, or the model's input)."""
    if source is not None:
        field = layouts.get(source) if layouts is not None else None
        if field is None:
            return None  # the keys, given with the batch, say which sample each row is
        counts = field.counts if field.counts is not None and len(field.counts) == samples else None
        if counts is None and field.varying is not None:
            return (
                f"which sample each row of its input, the batch's `{source}`, is cannot be "
                f"checked: the collate_fn built it from the samples' values (a processor or "
                f"tokenizer called in the collate_fn, a renamed field), and in the samples "
                f"{field.varying} per sample, so a row could be stored under another sample's "
                f"key. Return `{source}` from the dataset, one tensor per sample, or key each "
                f"row. " + _FIX
            )
        if counts is not None and set(counts) != {1}:
            return (
                f"its input, the batch's `{source}`, has not one row per sample: its "
                f"{sum(counts)} rows are its {samples} samples' {_shown(counts)} rows "
                f"concatenated (as Hugging Face Llava's multi-image `pixel_values` are), so a "
                f"row would be stored under another sample's key. " + _FIX
            )
        return None
    for value in inputs:
        if isinstance(value, torch.Tensor) and value.ndim:
            why = _rows_inside(value, fields, layouts, samples, of)
            if why is not None:
                return why
    return None


def _rows_inside(
    value: torch.Tensor,
    fields: Mapping[Hashable, torch.Tensor],
    layouts: Mapping[Hashable, FieldLayout] | None,
    samples: int,
    of: str,
) -> str | None:
    """Why ``value`` (an input made in the model) may hold images of the samples rather than
    the samples: a batch field whose samples hold varying numbers of rows shaped as its
    rows (seen in the samples), one shaped as it that the collate_fn built from samples
    holding something in a varying number, or a stacked field of several such rows per
    sample that ``value`` is not a view of (seen in the batch alone). None for a ``value``
    of fewer than two dimensions: an image's row is never a number, and any field of one
    row per sample (token ids of varying lengths) would hold rows "shaped as" its ``()``."""
    if value.ndim < 2:
        return None
    rows = tuple(value.shape[1:])
    for name, tensor in fields.items():
        field = layouts.get(name) if layouts is not None else None
        shapes = field.samples if field is not None else None
        if shapes is not None and all(len(s) == len(rows) + 1 and s[1:] == rows for s in shapes):
            counts = tuple(s[0] for s in shapes)
            if len(set(counts)) > 1:
                return _images(of, name, f"whose samples hold {_shown(counts)} rows")
            continue  # one count for all: as many rows as samples only when it is one
        shape = tuple(tensor.shape)
        if field is not None and field.varying is not None and shape[1:] == rows:
            return _images(of, name, f"built from samples in which {field.varying}")
        if (
            len(shape) == len(rows) + 2
            and shape[0] == samples
            and shape[2:] == rows
            and shape[1] > 1
            and not _shares_storage(value, tensor)  # `field[:, 0]` is one row per sample
        ):
            return _images(of, name, f"whose samples hold up to {shape[1]} rows")
    return None


def _shares_storage(value: torch.Tensor, field: torch.Tensor) -> bool:
    try:
        return value.untyped_storage().data_ptr() == field.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
        return False


def _images(of: str, field: Hashable, held: str) -> str:
    return (
        f"its input is made in the model from {of} `{field}`, {held} shaped as its "
        f"rows: its rows are images, not samples (as Idefics3's "
        f"and SmolVLM's `pixel_values.view(B * N, ...)[real_images]` are), and a batch with "
        f"as many images as samples would store one sample's image under another's key. " + _FIX
    )


def _shown(counts: tuple[int, ...]) -> str:
    return ", ".join(str(c) for c in counts[:8]) + (", ..." if len(counts) > 8 else "")


def no_row_per_sample(where: Hashable, shape: tuple[int, ...], samples: int) -> str:
    """Why a call whose input ``where`` has not ``samples`` rows runs as it is."""
    return (
        f"its input `{where}` (shape {shape}) {NO_ROW} of the batch's {samples} "
        f"keys, and such calls run as they are (said once): a collate step that dropped "
        f"samples the keys do not know of, or rows that are not samples (Qwen2-VL's "
        f"flattened patches, LlavaNext's any-resolution tiles, a varying number of images "
        f"per sample). " + _FIX
    )


def loader_keeps_inputs(name: str) -> str:
    """Why the loader builds every sample in full although the dataset could leave fields
    out: ``name`` reads an input made in the model."""
    return (
        f"FrozenFeatureCache: the loader builds every sample with its inputs (the dataset "
        f"defines `speedkit_getitem`), because `{name}` is called on an input made in the "
        f"model (a reshape, a cast, a selection of the batch's field), not on a batch field "
        f"as the batch carries it: which field a served sample could leave out is not "
        f"known. Its features are still served; to have the loader leave the images out "
        f"too, pass the batch's field to it as it is."
    )
