"""The CPU step benchmark must keep measuring what docs/benchmarks.md quotes from it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from tests.helpers.modules import load_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_step.py"


def test_cpu_step_splits_the_step_and_flags_the_levers_that_change_numerics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened = 0
    open_image = Image.open

    def counting_open(*args: Any, **kwargs: Any) -> Any:
        nonlocal opened
        opened += 1
        return open_image(*args, **kwargs)

    monkeypatch.setattr(Image, "open", counting_open)
    module = load_module(SCRIPT)
    out = tmp_path / "step.json"
    assert module.main(["--batch-size", "8", "--batches", "2", "--rounds", "3",
                        "--no-compile", "--out", str(out)]) == 0  # fmt: skip
    saved = json.loads(out.read_text())
    kit = "AttentionSwap + FusedOptimizer (the kit on CPU)"
    names = ["plain (as written)", "AttentionSwap", kit, "bf16 autocast"]
    assert list(saved["compute_ms"]) == names
    errors = saved["grad_rel_error"]
    # The swap computes the same function to float32 rounding; bf16 autocast does not.
    assert errors["plain (as written)"] == 0.0
    assert errors["AttentionSwap"] < 1e-5
    assert errors[kit] == errors["AttentionSwap"]  # the optimizer is not in a gradient
    assert errors["bf16 autocast"] > 1e-4
    assert saved["swapped_kernels"]  # the swap really swapped something
    # A cached batch is a look-up and a collate; a decoded one reads eight JPEGs. Two
    # batches of 8 are decoded to fill the cache and twice to build the compute's
    # batches, then once a round by the plain loader, never by the cache.
    assert opened == 2 * 16 + 3 * 16
    rounds = saved["data_rounds_ms"]
    ratios = zip(rounds["decode"], rounds["sample_cache"], strict=True)
    assert saved["sample_cache_speedup"] == pytest.approx(
        statistics.median(d / c for d, c in ratios)
    )
    shares = saved["plain_operator_shares"]
    assert sum(shares.values()) == pytest.approx(1.0)
    assert 0 < shares["matmul"] < 1
    assert 0 < shares["optimizer (AdamW)"] < 1
    # Every round is kept; the plain step's data wait is what a loader alone removes.
    assert len(saved["compute_rounds_ms"]["plain (as written)"]) == 3
    decode = saved["data_ms"]["decode"]
    assert decode > 0.1  # milliseconds: eight JPEG decodes take more than 0.1 ms
    assert statistics.median(saved["data_rounds_ms"]["decode"]) == pytest.approx(decode)
    # above 1 by the decode time: what a loader alone removes
    steps = zip(rounds["decode"], saved["compute_rounds_ms"]["plain (as written)"], strict=True)
    assert saved["loader_alone_speedup"] == pytest.approx(
        statistics.median((d + t) / t for d, t in steps)
    )
