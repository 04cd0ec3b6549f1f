"""The PowerSGD rank benchmark must keep working; its numbers are in docs/distributed.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "powersgd_rank.py"


def test_powersgd_rank_trains_ddp_and_each_rank_and_says_how_much_was_compressed(
    demo_corpus: Path, tmp_path: Path
) -> None:
    out = tmp_path / "rank.json"
    # Two processes: Lightning re-runs the command line in the second, so a subprocess.
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--ranks", "1", "4", "--seeds", "0", "--steps", "102",
         "--batch-size", "4", "--data-dir", str(demo_corpus), "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["rank"]) for r in rows] == [
        ("ddp", None), ("ddp_powersgd rank 1", 1), ("ddp_powersgd rank 4", 4),
    ]  # fmt: skip
    ddp, rank1, rank4 = rows
    assert ddp["compression_ratio"] is None
    # PowerSGD compressed from step 100; rank 1 sends fewer elements than rank 4.
    assert rank1["compression_ratio"] > rank4["compression_ratio"] > 2
    for row in rows:
        assert 0 < row["held_out_loss"] < 10
        assert 0 < row["held_out_acc"] <= 1
