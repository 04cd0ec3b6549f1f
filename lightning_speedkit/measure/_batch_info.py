"""What SpeedMonitor reads of a training batch: its shape signature, samples and tokens.

Host metadata only (shapes and dtypes, never values), so reading a batch costs no
device sync. A step of several train loaders (Lightning's CombinedLoader) trains one
batch of each: its samples and tokens are summed over them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_speedkit.errors import SpeedkitConfigError
from lightning_speedkit.measure import _tensor_walk


@dataclass(frozen=True)
class BatchInfo:
    """One training step's batch: shapes and dtypes of its tensors, samples, tokens."""

    signature: tuple[tuple[tuple[int, ...], str], ...]
    samples: int
    tokens: int | None

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


def tokens(tensors: list[torch.Tensor]) -> int | None:
    """Tokens of one loader's batch: its largest 2-D integer tensor (``input_ids``)."""
    ids = [t for t in tensors if t.ndim == 2 and not t.is_floating_point() and not t.is_complex()]
    return max((t.numel() for t in ids), default=None)


class BatchReader:
    """Reads :class:`BatchInfo` from batches, with the user's functions where given.

    Args:
        samples_per_batch: ``batch -> samples``; by default the first dimension of each
            loader's first tensor. A batch with no tensor counts as one sample, said once.
        tokens_per_batch: ``batch -> tokens``; by default each loader's largest 2-D
            integer tensor, summed; None when there is none.

    Example::

        >>> reader = BatchReader()
        >>> batch = {"input_ids": torch.zeros(4, 16, dtype=torch.long)}
        >>> info = reader.read(batch, [batch])
        >>> info.samples, info.tokens
        (4, 64)
    """

    def __init__(
        self,
        samples_per_batch: Callable[[Any], int] | None = None,
        tokens_per_batch: Callable[[Any], int] | None = None,
    ) -> None:
        self.samples_per_batch = samples_per_batch
        self.tokens_per_batch = tokens_per_batch
        self._said_samples = False

    def read(self, batch: Any, parts: Sequence[Any]) -> BatchInfo:
        """``batch``'s info; ``parts`` are its loaders' batches (``[batch]`` for one loader)."""
        tensors = [list(_tensor_walk.tensors(part)) for part in parts]
        signature = tuple((tuple(t.shape), str(t.dtype)) for each in tensors for t in each)
        if self.samples_per_batch is not None:
            samples = int(number(self.samples_per_batch(batch), "samples_per_batch"))
        else:
            samples = sum(
                self._samples(part, found) for part, found in zip(parts, tensors, strict=True)
            )
        count: int | None
        if self.tokens_per_batch is not None:
            count = int(number(self.tokens_per_batch(batch), "tokens_per_batch"))
        else:
            counts = [n for found in tensors if (n := tokens(found)) is not None]
            count = sum(counts) if counts else None
        return BatchInfo(signature, samples, count)

    def _samples(self, batch: Any, tensors: list[torch.Tensor]) -> int:
        """Samples of one loader's batch: the first dimension of its first tensor."""
        if tensors and tensors[0].ndim:
            return int(tensors[0].shape[0])
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
