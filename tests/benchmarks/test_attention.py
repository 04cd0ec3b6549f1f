"""The attention benchmark must keep working; its numbers are recorded in docs/benchmarks.md."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.modules import load_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention.py"


def test_attention_benchmark_runs_and_writes_its_tables(tmp_path: Path) -> None:
    module = load_module(SCRIPT)
    out, plot = tmp_path / "attention.json", tmp_path / "attention.png"
    args = ["--device", "cpu", "--size", "tiny", "--seq", "128", "--repeats", "1"]
    args += [
        "--rounds",
        "1",
        "--steps",
        "1",
        "--batch",
        "2",
        "--out",
        str(out),
        "--plot",
        str(plot),
    ]
    result = module.main(args)
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    assert {r["backend"] for r in saved["attention"]} >= {"eager", "sdpa", "math"}
    (small, large) = saved["end_to_end"]
    assert (small["image_size"], large["image_size"]) == (32, 64)
    assert small["swapped_modules"] == 4
    assert small["reverted_modules"] == 0
    # each module's parity check, the decoder's included, is in the record
    assert [m["name"] for m in small["parity"]] == [
        "vision.blocks.0.attn",
        "vision.blocks.1.attn",
        "language_model.blocks.0.attn",
        "language_model.blocks.1.attn",
    ]
    assert {m["status"] for m in small["parity"]} == {"active"}
    assert all(0.0 <= m["parity_error"] < 1e-5 for m in small["parity"])  # fp32 on CPU
    assert large["tokens"] > small["tokens"]
    assert plot.stat().st_size > 10_000
