"""Garbage that says which process finalized it, and samples whose reads collect garbage.

A forked loader worker inherits its parent's uncollected garbage; a collection in the
worker may finalize it there, which hangs the worker when the garbage is a gloo process
group. These stand in for both, deterministically: the finalizer writes its process id,
and each read runs a full collection, as a worker's allocations eventually do.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import Dataset


class Finalized:
    """An object in a reference cycle whose finalizer appends its process id to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cycle = self

    def __del__(self) -> None:
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


class Collecting(Dataset[dict[str, torch.Tensor]]):
    """Samples of 16 float32 values whose every read runs a full garbage collection."""

    def __init__(self, n: int = 10) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gc.collect()
        return {"x": torch.full((16,), float(i))}


@contextlib.contextmanager
def uncollected_garbage(path: Path) -> Iterator[None]:
    """Leaves one :class:`Finalized` as garbage no collection of this process finds first."""
    gc.collect()
    gc.disable()  # a forked child inherits this; its explicit gc.collect() still runs
    try:
        Finalized(path)
        yield
    finally:
        gc.enable()
