"""The memory benchmark must keep working; its numbers are recorded in docs/benchmarks.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.modules import load_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "memory.py"


@pytest.mark.multiprocess
def test_memory_benchmark_runs_and_writes_its_tables(tmp_path: Path) -> None:
    module = load_module(SCRIPT)
    out = tmp_path / "memory.json"
    result = module.main(["--size", "tiny", "--image-size", "32", "--text-len", "16",
                          "--steps", "1", "--strategies", "ddp", "--repeats", "1",
                          "--work", str(tmp_path / "work"), "--out", str(out)])  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    plain, ckpt = saved["strategies"]
    assert (plain["checkpointing"], ckpt["checkpointing"]) == (False, True)
    for row in (plain, ckpt):
        assert len(row["ranks"]) == 2
        assert row["measured_bytes"] > 0
        assert row["planned_model_states"] == 16 * row["n_params"]  # fp32 AdamW under DDP
    act = saved["activations"]
    assert act["blocks"] == 8  # small preset: 4 vision + 4 decoder blocks
    assert act["saved_bytes"]["checkpointed"] < act["saved_bytes"]["plain"] / 4
