"""The CPU step benchmark must keep measuring what docs/benchmarks.md quotes from it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.helpers.modules import load_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_step.py"


def test_cpu_step_splits_the_step_and_flags_the_levers_that_change_numerics(
    tmp_path: Path,
) -> None:
    module = load_module(SCRIPT)
    out = tmp_path / "step.json"
    assert module.main(["--batch-size", "8", "--batches", "2", "--rounds", "3",
                        "--no-compile", "--out", str(out)]) == 0  # fmt: skip
    saved = json.loads(out.read_text())
    names = ["plain (as written)", "AttentionSwap (the kit)", "bf16 autocast"]
    assert list(saved["compute_ms"]) == names
    errors = saved["grad_rel_error"]
    # The swap computes the same function to float32 rounding; bf16 autocast does not.
    assert errors["plain (as written)"] == 0.0
    assert errors["AttentionSwap (the kit)"] < 1e-5
    assert errors["bf16 autocast"] > 1e-4
    assert saved["swapped_kernels"]  # the swap really swapped something
    # A cached batch is a look-up and a collate; a decoded one reads eight JPEGs.
    assert saved["sample_cache_speedup"] > 2
    shares = saved["plain_operator_shares"]
    assert sum(shares.values()) == pytest.approx(1.0)
    assert 0 < shares["matmul"] < 1
    assert 0 < shares["optimizer (AdamW)"] < 1
    # Every round is kept; the plain step's data wait is what a loader alone removes.
    assert len(saved["compute_rounds_ms"]["plain (as written)"]) == 3
    decode = saved["data_ms"]["decode"]
    assert decode > 0.1  # milliseconds: eight JPEG decodes take more than 0.1 ms
    assert statistics.median(saved["data_rounds_ms"]["decode"]) == pytest.approx(decode)
    assert saved["loader_alone_speedup"] > 1
