"""The in-memory store of the frozen-feature cache: one entry per sample, within a budget.

An entry is the rows one sample contributed to a module's output (one tensor per output
leaf, the batch dimension removed), kept in host memory. Entries are found by a key that
names the module, its weights' fingerprint, the call's signature, the dataset's
fingerprint and the sample, so features computed with other weights, another kind of
call or another dataset are never found. Once the budget is reached memory takes nothing
more: later samples run the module each time, unless a disk store
(:mod:`._frozen_disk`), which takes every entry, holds them.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Any

import torch

from lightning_speedkit import _validation
from lightning_speedkit.compute._frozen_disk import DiskStore
from lightning_speedkit.compute._memory_probe import _proc_kib

__all__ = ["FeatureStore", "budget_bytes", "free_host_bytes"]

Entry = tuple[torch.Tensor, ...]


def free_host_bytes() -> int | None:
    """Host memory available to new allocations, in bytes (Linux ``MemAvailable``, else
    the free pages); None where nothing tells."""
    available = _proc_kib("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def budget_bytes(budget: Any, free: int | None = None) -> int:
    """``budget`` in bytes: a number of bytes, or a share of free host memory (``"50%"``).

    Example::

        >>> budget_bytes(2**20), budget_bytes("25%", free=400)
        (1048576, 100)
        >>> budget_bytes("lots")
        Traceback (most recent call last):
        ...
        lightning_speedkit.errors.SpeedkitConfigError: `budget` must be a number of bytes or a share of free host memory, got 'lots' (a string); pass e.g. `budget='50%'` or `budget=8 * 2**30`.
    """  # noqa: E501
    why = "must be a number of bytes or a share of free host memory"
    fix = "pass e.g. `budget='50%'` or `budget=8 * 2**30`"
    if isinstance(budget, str):
        share = _validation.parse_number(budget.strip().removesuffix("%"))
        if not budget.strip().endswith("%") or share is None or not 0 < share <= 100:
            _validation.fail("budget", budget, why, fix)
        free = free_host_bytes() if free is None else free
        if free is None:
            _validation.fail(
                "budget",
                budget,
                "is a share of free host memory, which this system does not report",
                "pass a number of bytes",
            )
        return int(free * share / 100)
    return _validation.non_negative_int(
        "budget", budget, example=8 * 2**30, hint="or a share such as '50%'"
    )


class FeatureStore:
    """Entries by key, in host memory, up to ``budget`` bytes; with a ``disk`` store, every
    entry is also written there (keys are tuples whose last item is the sample's), and what
    memory does not hold is served from disk.

    Example::

        >>> store = FeatureStore(budget=64)
        >>> store.put("a", (torch.zeros(4),))  # 16 bytes
        True
        >>> store.put("b", (torch.zeros(16),))  # 64 more: over the budget, not stored
        False
        >>> store.get("a")[0].tolist(), store.get("b"), store.bytes, store.full
        ([0.0, 0.0, 0.0, 0.0], None, 16, True)
    """

    def __init__(self, budget: int, disk: DiskStore | None = None) -> None:
        self.budget = budget
        self.disk = disk
        self.bytes = 0
        self.memory_full = False
        self._entries: dict[Hashable, Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def full(self) -> bool:
        """Nothing more can be stored: the budget is reached and no disk store takes more."""
        return self.memory_full and (self.disk is None or self.disk.failed is not None)

    @property
    def disk_bytes(self) -> int:
        return self.disk.bytes if self.disk is not None else 0

    def get(self, key: Hashable) -> Entry | None:
        entry = self._entries.get(key)
        if entry is None and self.disk is not None and isinstance(key, tuple) and key:
            entry = self.disk.get(key[:-1], key[-1])
        return entry

    def put(self, key: Hashable, entry: Entry) -> bool:
        """Keep ``entry`` under ``key`` in memory unless it would pass the budget, and on
        disk when there is a disk store; whether it was kept anywhere."""
        held = self._put_memory(key, entry)
        if self.disk is not None and isinstance(key, tuple) and key:
            return self.disk.put(key[:-1], key[-1], entry, held=held) or held
        return held

    def _put_memory(self, key: Hashable, entry: Entry) -> bool:
        size = sum(t.numel() * t.element_size() for t in entry)
        if self.bytes + size > self.budget:
            self.memory_full = True
            return False
        old = self._entries.get(key)
        if old is not None:
            self.bytes -= sum(t.numel() * t.element_size() for t in old)
        self._entries[key] = entry
        self.bytes += size
        return True

    def drop(self, where: Any = None) -> None:
        """Forget every entry in memory whose key's first item is ``where`` (all when None).
        The disk keeps its shards: they are found again only under the same key."""
        for key in [k for k in self._entries if where is None or _first(k) == where]:
            self.bytes -= sum(t.numel() * t.element_size() for t in self._entries.pop(key))
        self.memory_full = False

    def reject(self, where: Any) -> None:
        """Forget what is stored for module ``where``, in memory and on disk: it proved wrong."""
        self.drop(where)
        if self.disk is not None:
            self.disk.reject(where)

    def take_lost(self) -> list[tuple[Hashable, ...]]:
        """Keys stored only in a disk shard whose write failed (gone since), once each."""
        if self.disk is None or not self.disk.lost:
            return []
        lost, self.disk.lost = self.disk.lost, []
        return lost


def _first(key: Hashable) -> Any:
    return key[0] if isinstance(key, tuple) and key else key
