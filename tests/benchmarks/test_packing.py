"""The packing benchmark keeps working; its numbers are recorded in docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.helpers.modules import load_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "packing.py"
TINY = [
    *("--steps", "6", "--docs-per-step", "8", "--max-len", "64", "--vocab", "32"),
    *("--dim", "16", "--layers", "1", "--heads", "2", "--warmup", "2", "--rounds", "1"),
]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_module(SCRIPT)


def test_the_corpus_is_long_tailed_as_instruction_data(bench: ModuleType) -> None:
    lengths = [len(d) - 1 for d in bench.corpus(2000, max_len=512, vocab=64)]
    assert min(lengths) >= 8
    assert max(lengths) == 512  # the tail reaches the longest
    assert 0.22 <= statistics.median(lengths) / 512 <= 0.28  # median about a quarter


def test_the_first_fit_arm_packs_the_same_batches_tighter(bench: ModuleType) -> None:
    args = argparse.Namespace(max_len=64, docs_per_step=8)
    data = bench.Documents(bench.corpus(32, max_len=64, vocab=32))
    packed = list(bench.loader("packed", data, args))
    tight = list(bench.loader("packed_ffd", data, args))
    assert [len(b["cu_seqlens"]) for b in packed] == [len(b["cu_seqlens"]) for b in tight]
    assert sum(b["input_ids"].shape[0] for b in tight) < sum(
        b["input_ids"].shape[0] for b in packed
    )
    assert bench.padding_share("packed_ffd", data, args) < bench.padding_share("packed", data, args)


def test_padding_share_is_the_padding_of_the_positions_run(bench: ModuleType) -> None:
    args = argparse.Namespace(max_len=64, docs_per_step=8)
    data = bench.Documents(bench.corpus(32, max_len=64, vocab=32))
    lengths = [len(d) - 1 for d in data.docs]
    padded = bench.batches("padded", lengths, 8, 64)
    positions = sum(len(b) * max(lengths[i] for i in b) for b in padded)
    assert bench.padding_share("padded", data, args) == pytest.approx(
        1 - sum(lengths) / positions, rel=1e-12
    )
    packed_rows = sum(b["input_ids"].shape[0] for b in bench.loader("packed", data, args))
    assert bench.padding_share("packed", data, args) == pytest.approx(
        1 - sum(lengths) / (packed_rows * 64), rel=1e-12
    )


def test_the_benchmark_runs_the_arms_side_by_side_and_writes_its_table(
    bench: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "packing.json"
    report = bench.main([*TINY, "--out", str(out)])
    assert json.loads(out.read_text()) == report
    rows = {row["arm"]: row for row in report["rows"]}
    assert list(rows) == ["padded", "bucketed", "packed", "packed_ffd"]
    assert rows["padded"]["x_padded"] == 1.0
    assert rows["bucketed"]["x_bucketed"] == 1.0
    # packed rows hold the same documents each step as padded: the same loss, to rounding
    assert rows["packed"]["loss_gap_to_padded"] <= 1e-5
    assert rows["packed_ffd"]["loss_gap_to_padded"] <= 1e-5
    assert len(rows["packed"]["losses"]) == 6
    shares = [rows[arm]["padding_share"] for arm in ("padded", "packed", "packed_ffd")]
    assert shares == sorted(shares, reverse=True)  # packing pads less, and FFD less again
    assert all(0 < row["attention_share"] < 1 for row in rows.values())
    assert report["real_tokens"] == sum(len(d) - 1 for d in bench.corpus(48, max_len=64, vocab=32))


@pytest.fixture(scope="module")
def sdpa_run(bench: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny run with the defaults (CPU, float32, ``sdpa``), for the others to compare."""
    return bench.main([*TINY, "--out", str(tmp_path_factory.mktemp("sdpa") / "packing.json")])


def test_the_record_says_where_and_how_it_ran_and_what_each_fit_gave(
    bench: ModuleType, sdpa_run: dict[str, Any]
) -> None:
    written = datetime.strptime(sdpa_run["date"], "%Y-%m-%d").replace(tzinfo=timezone.utc)
    assert 0 <= (datetime.now(timezone.utc) - written).days <= 1  # today (UTC), at its start
    assert (sdpa_run["device"], sdpa_run["torch"]) == ("cpu", torch.__version__)
    assert (sdpa_run["precision"], sdpa_run["backend"]) == ("32-true", "sdpa")
    assert sdpa_run["complete"] is True
    # each fit's rate as it ended (what a time limit would have kept): one round, in order
    rows = {row["arm"]: row for row in sdpa_run["rows"]}
    assert [(p["round"], p["arm"]) for p in sdpa_run["progress"]] == [(0, arm) for arm in rows]
    assert [p["tokens_per_sec"] for p in sdpa_run["progress"]] == [
        row["tokens_per_sec_rounds"][0] for row in rows.values()
    ]
    for row in rows.values():  # the decoder's one attention module, on the kernel asked for
        assert row["attention_kernels"] == {
            "backends": ["sdpa"], "swapped": 1, "reverted": 0, "reasons": []}  # fmt: skip


def test_flex_on_cpu_falls_back_per_document_and_keeps_the_documents_apart(
    bench: ModuleType, sdpa_run: dict[str, Any], tmp_path: Path
) -> None:
    """FlexAttention has no backward on CPU: every arm runs SDPA per document instead, said
    so, and trains exactly as the sdpa run. None is reverted to the model's own attention,
    which would attend across a packed row's documents (SpeedMonitor's FLOP count of the
    first step once made AttentionSwap revert every module under ``flex``)."""
    report = bench.main([*TINY, "--backend", "flex", "--out", str(tmp_path / "flex.json")])
    assert report["backend"] == "flex"
    fallback = "sdpa (flex unavailable: FlexAttention has no backward on CPU)"
    for row, sdpa in zip(report["rows"], sdpa_run["rows"], strict=True):
        assert row["attention_kernels"] == {
            "backends": [fallback], "swapped": 1, "reverted": 0, "reasons": []}  # fmt: skip
        assert row["losses"] == sdpa["losses"]
    assert all(row["loss_gap_to_padded"] <= 1e-5 for row in report["rows"][2:])


def test_the_precision_is_the_trainers(
    bench: ModuleType, sdpa_run: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "bf16.json"
    report = bench.main([*TINY, "--precision", "bf16-mixed", "--out", str(out)])
    assert json.loads(out.read_text())["precision"] == report["precision"] == "bf16-mixed"
    # bf16 autocast: float32's losses, rounded a little
    for row, full in zip(report["rows"], sdpa_run["rows"], strict=True):
        gaps = [abs(a - b) for a, b in zip(row["losses"], full["losses"], strict=True)]
        assert 0 < max(gaps) < 0.05


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU where there is none")
def test_a_gpu_run_without_a_gpu_is_refused_before_it_starts(
    bench: ModuleType, tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.main([*TINY, "--accelerator", "gpu", "--out", str(tmp_path / "packing.json")])
    assert exit_.value.code == 2
    assert not (tmp_path / "packing.json").exists()
