"""SampleCache: keep a map-style dataset's decoded samples in memory after their first read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["SampleCache", "sample_nbytes"]


def sample_nbytes(sample: Any) -> int:
    """Bytes of the tensors (and numpy arrays, bytes) in a sample, nested containers included."""
    if isinstance(sample, torch.Tensor):
        return sample.element_size() * sample.nelement()
    if isinstance(sample, (bytes, bytearray)):
        return len(sample)
    nbytes = getattr(sample, "nbytes", None)  # numpy arrays
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(sample, Mapping):
        return sum(sample_nbytes(v) for v in sample.values())
    if isinstance(sample, Sequence) and not isinstance(sample, str):
        return sum(sample_nbytes(v) for v in sample)
    return 0


class SampleCache(Dataset[Any]):
    """A map-style dataset whose samples are read once, then served from memory.

    For datasets whose ``__getitem__`` is costly (JPEG decoding, resizing,
    tokenizing) and small enough to hold: from the second epoch on, a sample costs a
    dictionary look-up. Samples come back exactly as the dataset first returned them,
    so training sees the same data in the same order.

    What to know:

    - The dataset's ``__getitem__`` must be deterministic: random augmentation
      inside it would be frozen at its first draw. Augment after the cache (in the
      collate function or on the device) instead.
    - Samples are shared, not copied: do not modify them in place (a collate
      function that stacks or pads makes new tensors, as the default one does).
    - The cache lives in the process that reads: with ``num_workers=0``, the main
      process; with workers, each worker keeps its own (pickling the cache to spawned
      workers is skipped, they start empty), so memory is up to one cache per worker
      and each warms up separately. It pays most where the loader runs in-process,
      or with few persistent workers.
    - ``max_bytes`` bounds the tensor bytes held per process; samples beyond it are
      read from the dataset each time. ``None``: no bound.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        max_bytes: most bytes of sample tensors to keep per process, or None.

    Example::

        >>> import torch
        >>> class Squares(torch.utils.data.Dataset):
        ...     reads = 0
        ...     def __len__(self): return 4
        ...     def __getitem__(self, i):
        ...         Squares.reads += 1
        ...         return torch.tensor([i * i])
        >>> cached = SampleCache(Squares())
        >>> [int(cached[i]) for i in (0, 1, 2, 3, 0, 1, 2, 3)]
        [0, 1, 4, 9, 0, 1, 4, 9]
        >>> Squares.reads, cached.hits, cached.misses
        (4, 4, 4)
    """

    def __init__(self, dataset: Dataset[Any], max_bytes: int | None = None) -> None:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise SpeedkitConfigError(
                f"SampleCache needs a map-style dataset (__getitem__ and __len__); got a "
                f"{type(dataset).__name__}. Iterable datasets have no index to cache by."
            )
        if max_bytes is not None and (
            isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0
        ):
            raise SpeedkitConfigError(
                f"`max_bytes` must be None or a non-negative int, got {max_bytes!r}."
            )
        self.dataset = dataset
        self.max_bytes = max_bytes
        self._samples: dict[int, Any] = {}
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        try:
            sample = self._samples[index]
        except KeyError:
            pass
        else:
            self.hits += 1
            return sample
        self.misses += 1
        sample = self.dataset[index]
        size = sample_nbytes(sample)
        if self.max_bytes is None or self.nbytes + size <= self.max_bytes:
            self._samples[index] = sample
            self.nbytes += size
        return sample

    def __getstate__(self) -> dict[str, Any]:
        # Spawned workers get the dataset, not the (possibly large) cache.
        state = dict(self.__dict__)
        state["_samples"], state["nbytes"], state["hits"], state["misses"] = {}, 0, 0, 0
        return state

    def clear(self) -> None:
        """Drop every cached sample (e.g. after the files behind the dataset changed)."""
        self._samples.clear()
        self.nbytes = 0

    def __getattr__(self, name: str) -> Any:
        # The wrapped dataset's own attributes (e.g. ``caption_lengths``) stay reachable.
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)
