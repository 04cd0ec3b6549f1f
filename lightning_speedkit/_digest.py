"""A value's content fed to a hash: what the kit's fingerprints and sample digests share."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["feed"]


def _type_name(value: Any) -> bytes:
    return type(value).__qualname__.encode()


def feed(digest: Any, value: Any, other: Callable[[Any], bytes] = _type_name) -> None:
    """Feed ``value``'s content to ``digest`` (``hashlib``'s): tensors and arrays by dtype,
    shape and bytes, mappings by their items in the order of their keys' reprs, sequences
    by their items, plain values by their repr, anything else by ``other(value)`` (default:
    its type's name, the same in every process; ``pickle.dumps`` tells such objects apart
    by content).

    Example::

        >>> import hashlib
        >>> def digest(value):
        ...     d = hashlib.blake2b(digest_size=8)
        ...     feed(d, value)
        ...     return d.hexdigest()
        >>> digest({"x": torch.arange(3), "y": 1}) == digest({"y": 1, "x": torch.arange(3)})
        True
        >>> digest(torch.arange(3)) == digest(torch.arange(3.0))
        False
    """
    if isinstance(value, torch.Tensor):
        digest.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, Mapping):
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            feed(digest, value[key], other)
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            feed(digest, item, other)
    elif isinstance(value, (str, bytes, int, float, bool, type(None))):
        digest.update(repr(value).encode())
    elif callable(getattr(value, "tobytes", None)):  # numpy arrays, PIL images
        digest.update(f"{type(value).__name__}{getattr(value, 'shape', '')}".encode())
        digest.update(value.tobytes())
    else:
        digest.update(other(value))
