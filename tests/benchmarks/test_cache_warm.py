"""The benchmark script must keep working; its numbers are recorded in docs/benchmarks.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import SMALL_CORPUS
from tests.helpers.modules import load_on_small_corpus

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cache_warm.py"


def test_cache_warm_runs_and_writes_its_table(
    small_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_on_small_corpus(SCRIPT, monkeypatch)
    out = tmp_path / "warm.json"
    report = module.main(["--data-dir", str(small_corpus), "--rounds", "2", "--workers", "1",
                          "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == report
    assert report["samples"] == SMALL_CORPUS.train_samples
    rows = {row["num_workers"]: row for row in report["rows"]}
    assert set(rows) == {0, 1}
    assert rows[0]["speedup"] == 1.0
    assert all(len(row["rounds"]) == 2 for row in rows.values())
    assert rows[1]["speedup"] == pytest.approx(rows[0]["seconds"] / rows[1]["seconds"])
