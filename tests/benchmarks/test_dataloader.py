"""The dataloader benchmark's side-by-side check of the tuner's pick against the grid's best."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.helpers.modules import load_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "dataloader.py"
TWO_WORKERS = {"num_workers": 2, "pin_memory": False, "persistent_workers": False}


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_module(SCRIPT)


def test_the_same_setting_is_not_timed_again(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_timing(*args: Any, **kwargs: Any) -> float:
        raise AssertionError("timed a setting against itself")

    monkeypatch.setattr(bench, "_measure", no_timing)
    pick = {**TWO_WORKERS, "prefetch_factor": 2}
    best = {**pick, "batches_per_sec": 150.0, "samples_per_sec": 4800.0, "rounds": [150.0]}
    result = bench._side_by_side(object(), pick, best, rounds=5, batches=10)
    assert result == {"same_setting": True, "pick": [], "best": [], "pick_over_best": 1.0}


def test_pick_and_best_alternate_and_compare_medians(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each loader is tagged with its prefetch factor; the rates play the grid's luck: the
    # best had one lucky round (200), its median is the pick's.
    rates = {2: iter([100.0, 104.0, 98.0]), 8: iter([200.0, 99.0, 100.0])}
    timed: list[int] = []

    def rebuild(loader: object, **settings: Any) -> int:
        assert settings["num_workers"] == 2
        assert "batches_per_sec" not in settings
        return int(settings["prefetch_factor"])

    def measure(prefetch: int, *args: Any, **kwargs: Any) -> float:
        timed.append(prefetch)
        return next(rates[prefetch])

    monkeypatch.setattr(bench, "rebuild_dataloader", rebuild)
    monkeypatch.setattr(bench, "_measure", measure)
    pick = {**TWO_WORKERS, "prefetch_factor": 2}
    best = {**TWO_WORKERS, "prefetch_factor": 8, "batches_per_sec": 200.0}
    result = bench._side_by_side(object(), pick, best, rounds=3, batches=10)
    assert timed == [2, 8, 8, 2, 2, 8]  # interleaved, the order turned each round
    assert result["pick"] == [100.0, 104.0, 98.0]
    assert result["best"] == [200.0, 99.0, 100.0]
    assert result["pick_over_best"] == pytest.approx(1.0)  # medians 100 and 100
