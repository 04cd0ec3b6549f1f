"""The memory benchmark must keep working; its numbers are recorded in docs/benchmarks.md."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

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
        assert 0 < row["measured_bytes"] < row["rss_bytes"] + 64 * 2**20
        assert row["planned_phase"] == "forward/backward"  # DDP's rebuilt buckets
        assert row["planned_model_states"] == 16 * row["n_params"]  # fp32 AdamW under DDP
    act = saved["activations"]
    assert act["blocks"] == 8  # small preset: 4 vision + 4 decoder blocks
    assert act["saved_bytes"]["checkpointed"] < act["saved_bytes"]["plain"] / 4


def test_cpu_peak_is_the_most_bytes_torch_tensors_held_at_once() -> None:
    module = load_module(SCRIPT)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        a = torch.ones(1_000_000)  # 4 MB
        b = a.sqrt() / 2  # the sqrt and the quotient at once: 12 MB, then 8 MB
        del a, b
        c = torch.ones(2_000_000)  # 8 MB alone
        del c
    assert module._peak_tensor_bytes(prof) == pytest.approx(12_000_000, abs=4096)


@pytest.mark.parametrize("recorded", ["memory_cpu.json", "memory_cuda.json"])
def test_the_plan_still_predicts_the_recorded_peaks(recorded: str) -> None:
    """Re-plan every recorded run with today's plan_memory: a change to the plan that moves
    it away from what was measured (on two CPU processes, on one H100) fails here."""
    from lightning_speedkit.distributed import plan_memory

    saved = json.loads((SCRIPT.parent / "results" / recorded).read_text())
    cuda = "cuda" in saved["meta"]["command"]
    devices = saved["meta"]["devices"]
    for row in saved["strategies"]:
        plan = plan_memory(row["n_params"], devices, optimizer="adamw",
                           precision="mixed" if cuda else "fp32",
                           device="cuda" if cuda else "cpu")  # fmt: skip
        estimate = replace(plan.per_device(row["strategy"]), activations=row["planned_activations"])
        assert estimate.total == pytest.approx(row["measured_bytes"], rel=0.08), row["strategy"]
