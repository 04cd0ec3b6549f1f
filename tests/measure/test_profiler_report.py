"""analyse_window / report_window: a window's report from its trace, never fatal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_speedkit.measure._profiler_report import analyse_window, report_window
from lightning_speedkit.measure._profiler_rivals import other_profiler, stand_down_message
from lightning_speedkit.measure.report import Report, analyze_trace


def cpu_trace(path: Path) -> Path:
    """One 1000 us CPU step: 250 us of fetching, then a 500 us addmm."""
    events = [
        {"name": "ProfilerStep#1", "cat": "user_annotation", "ph": "X", "ts": 0, "dur": 1000,
         "pid": 1, "tid": 1},
        {"name": "speedkit/data_fetch", "cat": "user_annotation", "ph": "X", "ts": 0,
         "dur": 250, "pid": 1, "tid": 1},
        {"name": "aten::addmm", "cat": "cpu_op", "ph": "X", "ts": 250, "dur": 500, "pid": 1,
         "tid": 1},
    ]  # fmt: skip
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_the_report_takes_the_unprofiled_share_and_is_written_per_rank(tmp_path: Path) -> None:
    raw = cpu_trace(tmp_path / "w.json")
    report, files = report_window(raw, source="w.gz", directory=tmp_path, rank=1, memory=None,
                                  unprofiled=(0.5, 2.0), callbacks=[])  # fmt: skip
    assert report.source == "w.gz"
    assert report.breakdown["data"] == pytest.approx(0.5)
    assert report.breakdown["matmul"] == pytest.approx(0.5 * 0.5 / 0.75)
    assert sorted(p.name for p in files) == [
        "speedkit_report-rank1.json",
        "speedkit_report-rank1.md",
        "speedkit_report-rank1.png",
    ]


def test_the_analysis_is_given_what_the_run_measured(tmp_path: Path) -> None:
    calls: list[dict[str, Any]] = []

    def analyze(raw: Path, **kwargs: Any) -> Report:
        calls.append(kwargs)
        return analyze_trace(raw, **kwargs)

    raw = cpu_trace(tmp_path / "w.json")
    made = analyse_window(raw, tmp_path / "rank0-window0.pt.trace.json.gz", rank=0,
                          device=torch.device("cpu"), warn_once=lambda k, m: None,
                          unprofiled=(None, None), callbacks=["AttentionSwap"],
                          analyze=analyze)  # fmt: skip
    assert made is not None
    assert calls == [{"memory": None, "source": "rank0-window0.pt.trace.json.gz",
                      "unprofiled_data_share": None, "unprofiled_step_ms": None}]  # fmt: skip
    assert made[1][0] == tmp_path / "speedkit_report.md"


def test_a_failing_analysis_costs_only_the_report(tmp_path: Path) -> None:
    said: list[tuple[str, str]] = []

    def broken(raw: Path, **kwargs: Any) -> Report:
        raise ValueError("planted")

    made = analyse_window(tmp_path / "w.json", tmp_path / "w.gz", rank=0,
                          device=torch.device("cpu"), warn_once=lambda k, m: said.append((k, m)),
                          unprofiled=(None, None), callbacks=[], analyze=broken)  # fmt: skip
    assert made is None
    assert said == [("report", "ProfilerSchedule: the report of w.gz failed (ValueError: "
                               "planted); traces are still written.")]  # fmt: skip
    assert list(tmp_path.iterdir()) == []


def test_no_other_profiler_no_stand_down() -> None:
    from types import SimpleNamespace

    assert other_profiler(SimpleNamespace(profiler=None)) is None
    assert stand_down_message("X", "keep Y") == (
        "ProfilerSchedule stands down: X already runs torch.profiler, and two profilers in "
        "one process crash it. Keep one: keep Y."
    )
