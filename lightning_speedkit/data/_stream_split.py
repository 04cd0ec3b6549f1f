"""Whether an ``IterableDataset`` splits its stream among a loader's workers.

A map-style dataset's sampler hands each worker its own indices; an ``IterableDataset``
is copied into every worker, and each copy yields the whole stream unless it splits it
itself (``torch.utils.data.get_worker_info()``, webdataset's ``split_by_worker``). Two
workers over one that does not yield every sample twice, and read twice as fast: a
search for the fastest worker count took that for a speed-up, and every epoch after
trained on each sample twice, silently.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_speedkit import _compat
from lightning_speedkit.data.rebuild import rebuild_dataloader

__all__ = ["repeats_in_each_worker"]


def repeats_in_each_worker(loader: DataLoader[Any]) -> bool:
    """Whether ``loader``'s ``IterableDataset`` gives each of two workers the same first
    batch (it does not split its stream). Two workers are started, for two batches."""
    if not isinstance(loader.dataset, IterableDataset):
        return False
    two = rebuild_dataloader(loader, num_workers=2, persistent_workers=False, pin_memory=False,
                             prefetch_factor=1)  # fmt: skip
    batches = []
    iterator = iter(two)  # batches come from the workers in turn: worker 0's, worker 1's
    try:
        batches = [next(iterator), next(iterator)]
    except StopIteration:
        return False  # one batch in all: workers cannot repeat a second
    finally:
        del iterator  # its workers stop with it
    return _same(*batches)


def _same(a: Any, b: Any) -> bool:
    """Two batches of the same structure and equal leaves (tensors by value)."""
    tree_flatten, _ = _compat.tree_flatten_and_map()
    (left, left_spec), (right, right_spec) = tree_flatten(a), tree_flatten(b)
    return left_spec == right_spec and all(map(_same_leaf, left, right))


def _same_leaf(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return x.dtype == y.dtype and torch.equal(x, y)  # equal shapes too
    try:
        return type(x) is type(y) and bool(x == y)
    except (TypeError, ValueError, RuntimeError):  # an array's ==: undecided, so different
        return False
