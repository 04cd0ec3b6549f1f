"""speedkit bench-attention: real measurements, a table, JSON and a plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_speedkit import SpeedkitConfigError
from lightning_speedkit.attention.bench import bench_attention
from lightning_speedkit.cli import main


def test_fused_backends_save_attention_memory_and_time_on_long_sequences() -> None:
    rows = bench_attention(
        [512], kv_heads=[2], backends=["sdpa", "math"], repeats=1, device="cpu", progress=False
    )
    by_backend = {r.backend: r for r in rows}
    eager, sdpa, math = by_backend["eager"], by_backend["sdpa"], by_backend["math"]
    # Eager keeps the probabilities (1 x 8 x 512 x 512 fp32 = 8 MiB) for backward.
    assert eager.memory_mib is not None
    assert eager.memory_mib >= 8
    assert sdpa.memory_ratio is not None
    assert sdpa.memory_ratio > 4  # the fused kernel keeps O(N) statistics, not O(N^2) scores
    assert math.memory_ratio is not None
    assert math.memory_ratio < 1.5  # the reference kernel materialises them too
    assert eager.speedup == 1.0


def test_shapes_that_would_not_fit_are_skipped_not_run() -> None:
    rows = bench_attention([4096], kv_heads=[8], backends=["sdpa"], batch=64, device="cpu",
                           memory_limit_gib=1.0, progress=False)  # fmt: skip
    assert {r.ms for r in rows} == {None}
    assert all("skipped: eager scores need 64.0 GiB" in r.note for r in rows)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(SpeedkitConfigError, match="`kv_heads=3` must divide `heads=8`"):
        bench_attention([64], kv_heads=[3], progress=False)
    with pytest.raises(SpeedkitConfigError, match="`seq_lens` must be positive"):
        bench_attention([0], progress=False)


def test_cli_prints_the_table_and_writes_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--seq", "128", "--kv-heads", "4", "--backends", "sdpa", "efficient", "--repeats", "1"]
    code = main(["bench-attention", *args, "--device", "cpu", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "| 128 | 64 | 8 (4) | eager |" in out
    assert "ran sdpa (efficient unavailable" in out  # no CPU kernel: said, not hidden
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["backend"] for r in saved["rows"]] == ["eager", "sdpa", "efficient"]
    assert saved["causal"] is True
    assert (tmp_path / "attention.png").stat().st_size > 10_000


def test_cli_bad_input_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench-attention", "--kv-heads", "3", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "argument --kv-heads: 3 does not divide --heads 8" in err  # the argument, the value
    assert "give divisors of --heads" in err  # and the fix
    assert len(err.strip().splitlines()) == 1  # one line, no traceback
