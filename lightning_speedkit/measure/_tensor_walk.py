"""Every tensor in a nested collection, in order: a batch, or a module's output."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a batch or a module's output, in order, through what Lightning's
    ``apply_to_collection`` walks: mappings (``dict``, Hugging Face's ``BatchEncoding`` and
    ``ModelOutput``, a ``UserDict``), lists and tuples (named ones too), and dataclass
    instances.

    Example::

        >>> batch = {"ids": torch.zeros(2, 3), "pair": (torch.ones(1), [torch.ones(2)])}
        >>> [tuple(t.shape) for t in tensors(batch)]
        [(2, 3), (1,), (2,)]
    """
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for each in dataclasses.fields(value):
            yield from tensors(getattr(value, each.name, None))
