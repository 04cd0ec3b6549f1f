"""The cores loader workers may have: this rank's share of the machine."""

from __future__ import annotations

import os

import pytest

from lightning_speedkit.data import worker_cores


@pytest.mark.parametrize(("local_world_size", "budget"), [(1, 8), (2, 4), (3, 2), (16, 1), (0, 8)])
def test_the_budget_is_this_processs_cores_shared_among_the_local_ranks(
    monkeypatch: pytest.MonkeyPatch, local_world_size: int, budget: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert worker_cores.cpu_budget(local_world_size) == budget


def test_without_affinity_the_budget_counts_every_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert worker_cores.cpu_budget(4) == 1
    assert worker_cores.cpu_budget(1) == 6
