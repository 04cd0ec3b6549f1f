"""The frozen-tower benchmark keeps working; its numbers are recorded in docs/frozen-features.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.modules import load_on_small_corpus

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "frozen_tower.py"


def test_frozen_tower_runs_side_by_side_and_writes_its_table(
    small_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_on_small_corpus(SCRIPT, monkeypatch)
    out = tmp_path / "frozen.json"
    report = module.main(["--data-dir", str(small_corpus), "--batches", "2", "--batch-size", "4",
                          "--epochs", "3", "--rounds", "1", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == report
    (row,) = report["rows"]
    assert row["same_losses"] is True  # the cache changes no loss
    # epoch 0 runs 8 samples; epoch 1 verifies on batch 1 (4 run), serves batch 2; epoch 2 serves
    assert (row["misses"], row["hits"]) == (12, 12)
    assert row["store_bytes"] == 8 * 16 * 64 * 4  # 16 image tokens x 64 wide, float32
    assert row["timed_steps"] == 2
    assert row["ideal_speedup"] == pytest.approx(1 / (1 - row["tower_share"]))
    assert row["speedup"] == pytest.approx(row["cached_steps_per_sec"] / row["plain_steps_per_sec"])
    assert 0 < row["tower_share"] < 1
