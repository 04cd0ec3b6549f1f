"""The profiler-overhead benchmark must keep working; its numbers are in docs/benchmarks.md."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.modules import load_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profiler_overhead.py"


def test_profiler_overhead_runs_and_writes_its_table(tmp_path: Path) -> None:
    module = load_module(SCRIPT)
    out = tmp_path / "overhead.json"
    report = module.main(["--repeats", "1", "--steps", "4", "--warmup", "2", "--batch-size", "4",
                          "--work", str(tmp_path / "traces"), "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == report
    rows = {row["config"]: row for row in report["rows"]}
    assert set(rows) == {"none", "profiler_idle"}
    assert rows["none"]["ratio_to_none"] == 1.0
    assert report["traces_written"] == 0  # the window never came: nothing was profiled
    assert 0 < report["hook_us_per_step"] < 10_000
