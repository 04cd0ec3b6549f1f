"""The benchmark script must keep working; its numbers are recorded in docs/benchmarks.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.modules import load_on_small_corpus

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "monitor_overhead.py"


@pytest.mark.slow
def test_monitor_overhead_runs_and_writes_its_table(
    small_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_on_small_corpus(SCRIPT, monkeypatch)  # not the default corpus
    out = tmp_path / "overhead.json"
    report = module.main([
        "--data-dir", str(small_corpus), "--repeats", "1", "--steps", "4", "--warmup", "3",
        "--batch-size", "8", "--distinct-batches", "2", "--out", str(out),
    ])  # fmt: skip
    assert json.loads(out.read_text()) == report
    rows = {row["config"]: row for row in report["rows"]}
    assert set(rows) == {"none", "speed_monitor", "throughput_monitor"}
    assert rows["none"]["ratio_to_none"] == 1.0
    assert all(row["step_ms_median"] > 0 for row in rows.values())
    assert report["speed_monitor_flop_counts"] >= 1
    cost = report["flop_count_cost"]
    assert cost["counted_step_ms"] > cost["plain_step_ms"] > 0
