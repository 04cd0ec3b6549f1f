"""The bucket-size benchmark: how it orders and summarises runs, and the results it recorded.

The benchmark itself needs root and two network namespaces, and even its ``--quick``
mode starts two Lightning processes per link rate (about 30-40 s on two shared cores),
so the suite tests its pure parts on made-up measurements and checks the committed
results (``benchmarks/results/ddp_buckets.json``), which docs/benchmarks.md quotes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helpers.modules import load_module
from tests.helpers.multiprocess import REPO

SCRIPT = REPO / "benchmarks" / "ddp_buckets.py"
RESULTS = REPO / "benchmarks" / "results" / "ddp_buckets.json"
bench = load_module(SCRIPT)


def test_every_cell_runs_once_a_round_and_no_cell_is_always_first() -> None:
    cells = [("ddp", 1.0), ("ddp", 25.0), ("ddp_fp16_compress", 1.0)]
    order = bench.cell_order(cells, rounds=4)
    assert order == [cells[0], cells[1], cells[2],
                     cells[1], cells[2], cells[0],
                     cells[2], cells[0], cells[1],
                     cells[0], cells[1], cells[2]]  # fmt: skip


def _cell(strategy: str, cap: float, step_ms: list[float], sent: float) -> dict[str, Any]:
    return {"strategy": strategy, "bucket_cap_mb": cap, "buckets": int(100 // cap),
            "step_ms": step_ms, "round_ms": [step_ms[0], step_ms[-1]],
            "bytes_per_step": [sent, sent, 2 * sent]}  # fmt: skip


def test_summary_takes_the_slower_rank_and_compares_with_the_default_bucket() -> None:
    rank0 = {"cells": [_cell("ddp_fp16_compress", 25.0, [40.0, 50.0, 60.0], 2**19),
                       _cell("ddp", 25.0, [100.0, 110.0, 300.0], 2**20),
                       _cell("ddp", 1.0, [70.0, 80.0, 90.0], 2**20)],
             "compute_ms": [20.0, 30.0, 25.0]}  # fmt: skip
    rank1 = {"cells": [_cell("ddp_fp16_compress", 25.0, [45.0, 55.0, 65.0], 3 * 2**19),
                       _cell("ddp", 25.0, [90.0, 120.0, 130.0], 2**20),
                       _cell("ddp", 1.0, [60.0, 88.0, 89.0], 2**20)],
             "compute_ms": [10.0, 40.0, 40.0]}  # fmt: skip
    rows = bench.summarize("1gbit", [rank0, rank1])
    # Sorted by strategy then bucket size; each median is the slower rank's.
    assert [(r["strategy"], r["bucket_cap_mb"]) for r in rows] == [
        ("ddp", 1.0), ("ddp", 25.0), ("ddp_fp16_compress", 25.0)]  # fmt: skip
    ddp1, ddp25, fp16 = rows
    assert ddp25["step_ms"] == 120.0  # medians 110 and 120
    assert ddp1["step_ms"] == 88.0  # medians 80 and 88
    assert ddp25["round_ms"] == [100.0, 300.0]  # per round, the slower rank
    assert ddp1["vs_25mb"] == pytest.approx(120.0 / 88.0)
    assert ddp25["vs_25mb"] == 1.0
    assert fp16["mib_sent_per_step"] == pytest.approx(1.0)  # mean of 0.5 and 1.5 MiB
    assert fp16["rate"] == "1gbit"
    assert bench.compute_only_ms([rank0, rank1]) == 40.0  # medians 25 and 40

    text = bench.table(rows, {"1gbit": 40.0})
    assert text.splitlines()[1].split() == ["1gbit", "ddp", "1", "100", "88.0", "70/90", "1.00",
                                            "1.36x"]  # fmt: skip
    assert text.splitlines()[-1].split() == ["1gbit", "(compute", "only)", "-", "-", "40.0"]


def test_a_run_with_only_warm_up_steps_is_refused() -> None:
    assert bench._median_after([5.0, 1.0, 2.0, 9.0], warmup=1) == 2.0
    with pytest.raises(ValueError, match="nothing left"):
        bench._median_after([5.0, 1.0], warmup=2)


@pytest.mark.parametrize("argv", [["--warmup", "0"], ["--steps", "0"], ["--buckets", "0"]])
def test_bad_settings_stop_before_any_namespace_is_made(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        bench.main(argv)
    assert stopped.value.code == 2  # argparse's usage error, raised before the root check


def test_recorded_results_measure_every_cell_and_fp16_sends_half() -> None:
    report = json.loads(RESULTS.read_text())
    settings = report["settings"]
    assert settings["quick"] is False
    assert settings["rates"] == ["1gbit", "10gbit"]
    assert report["threads_per_rank"] == [1]
    rows = report["rows"]
    cells = {(r["rate"], r["strategy"], r["bucket_cap_mb"]) for r in rows}
    assert cells == {(rate, strategy, cap) for rate in settings["rates"]
                     for strategy in ("ddp", "ddp_fp16_compress")
                     for cap in (1.0, 5.0, 25.0, 100.0)}  # fmt: skip
    assert len(rows) == len(cells)
    grad_mib = report["model"]["grad_mib"]
    by = {(r["rate"], r["strategy"], r["bucket_cap_mb"]): r for r in rows}
    for (rate, strategy, cap), row in by.items():
        assert len(row["round_ms"]) == settings["rounds"]
        assert row["step_ms"] > report["compute_only_ms"][rate] > 0
        if strategy == "ddp":  # every fp32 gradient byte crossed the veth, once
            assert grad_mib <= row["mib_sent_per_step"] < 1.05 * grad_mib
            fp16 = by[(rate, "ddp_fp16_compress", cap)]
            assert fp16["mib_sent_per_step"] / row["mib_sent_per_step"] == pytest.approx(0.5, 0.02)
            assert fp16["buckets"] == row["buckets"]
            assert row["step_ms"] > by[("10gbit", "ddp", cap)]["step_ms"] or rate == "10gbit"
    for strategy in ("ddp", "ddp_fp16_compress"):  # more MiB per bucket, fewer buckets
        counts = [by[("1gbit", strategy, cap)]["buckets"] for cap in (1.0, 5.0, 25.0, 100.0)]
        assert counts == sorted(counts, reverse=True)
        assert counts[0] > counts[-1] >= 1


def test_the_docs_quote_the_recorded_step_times() -> None:
    docs = (REPO / "docs" / "benchmarks.md").read_text()
    section = docs[docs.index("## DDP bucket size (`benchmarks/ddp_buckets.py`)") :]
    section = section[: section.find("\n## ", 1)]
    for row in json.loads(RESULTS.read_text())["rows"]:
        assert f"{row['step_ms']:.1f}" in section, row
