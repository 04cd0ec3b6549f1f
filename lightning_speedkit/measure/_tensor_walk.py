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


def named_fields(value: Any) -> Mapping[Any, Any] | None:
    """A batch's fields by name: a mapping itself, a namedtuple's or a dataclass
    instance's fields; None for anything else (a plain list or tuple, a tensor).

    Example::

        >>> from collections import namedtuple
        >>> Batch = namedtuple("Batch", "input_ids attention_mask")
        >>> list(named_fields(Batch(1, 2)))
        ['input_ids', 'attention_mask']
        >>> named_fields([1, 2]) is None
        True
    """
    if isinstance(value, Mapping):
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return dict(zip(value._fields, value, strict=True))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {each.name: getattr(value, each.name, None) for each in dataclasses.fields(value)}
    return None


def named_containers(batch: Any) -> list[tuple[str, Mapping[Any, Any]]]:
    """Every container in ``batch`` that names its fields, with its path (``batch[0]``,
    ``batch['inputs']``, ``batch.inputs``), outer ones first: through what Lightning's
    ``apply_to_collection`` walks (mappings, lists and tuples, namedtuples, dataclass
    instances), each read as :func:`named_fields` reads it.

    Example::

        >>> batch = ([1, 2], {"inputs": {"cu_seqlens": 3}})
        >>> [path for path, _ in named_containers(batch)]
        ['batch[1]', "batch[1]['inputs']"]
    """
    found: list[tuple[str, Mapping[Any, Any]]] = []
    seen: set[int] = set()
    todo: list[tuple[str, Any]] = [("batch", batch)]
    while todo:
        path, node = todo.pop()
        if isinstance(node, torch.Tensor) or id(node) in seen:
            continue
        fields = named_fields(node)
        if fields is not None:
            found.append((path, fields))
            key = "{}[{!r}]" if isinstance(node, Mapping) else "{}.{}"
            children = [(key.format(path, name), value) for name, value in fields.items()]
        elif isinstance(node, (list, tuple)):
            children = [(f"{path}[{i}]", value) for i, value in enumerate(node)]
        else:
            continue
        seen.add(id(node))  # a container met again (or holding itself) is read once
        todo.extend(reversed(children))
    return found
