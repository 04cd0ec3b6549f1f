"""The quick GPU check's records: what a test file's run and each part left behind."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.modules import load_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quick_record.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.attention.test_swap" name="test_a" time="0.1"/>
<testcase classname="tests.attention.test_swap" name="test_b" time="0.1">
  <failure message="AssertionError: reverted&#10;second line">trace</failure></testcase>
<testcase classname="tests.attention.test_swap" name="test_c" time="0.1">
  <error message="failed on setup with &quot;OSError&quot;">trace</error></testcase>
<testcase classname="tests.attention.test_swap" name="test_d" time="0.0">
  <skipped message="needs flash-attn"/></testcase>
</testsuite></testsuites>
"""


def test_each_test_file_is_recorded_with_its_counts_and_failures(tmp_path: Path) -> None:
    module = load_module(SCRIPT)
    (tmp_path / "quick_tests.xml").write_text(JUNIT)
    (tmp_path / "quick_tests_files.txt").write_text(
        "tests/attention/test_swap.py\ntests/compute/test_zero2.py\n"
    )
    (tmp_path / "quick_tests.tsv").write_text("1\t12\n")
    assert module.main(["tests", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "quick_tests.json").read_text())
    assert (record["exit"], record["seconds"], record["complete"]) == (1, 12, True)
    swap, zero2 = record["files"]
    assert {k: v for k, v in swap.items() if k != "problems"} == {
        "file": "tests/attention/test_swap.py", "ran": True,
        "tests": 4, "passed": 1, "failed": 1, "errors": 1, "skipped": 1,
    }  # fmt: skip
    assert swap["problems"] == [
        {"test": "tests.attention.test_swap::test_b", "outcome": "failed",
         "message": "AssertionError: reverted"},
        {"test": "tests.attention.test_swap::test_c", "outcome": "errors",
         "message": 'failed on setup with "OSError"'},
    ]  # fmt: skip
    assert (zero2["ran"], zero2["tests"]) == (False, 0)  # selected, no test reported
    assert record["totals"] == {"tests": 4, "passed": 1, "failed": 1, "errors": 1, "skipped": 1,
                                "files_not_reached": 1}  # fmt: skip


def test_a_run_cut_off_is_recorded_from_its_printed_outcomes(tmp_path: Path) -> None:
    module = load_module(SCRIPT)
    (tmp_path / "quick_tests_files.txt").write_text(
        "/work/repo/tests/attention/test_swap.py\n/work/repo/tests/compute/test_zero2.py\n"
    )
    (tmp_path / "quick_tests_progress.log").write_text(
        "tests/attention/test_swap.py::test_a PASSED                 [ 25%]\n"
        "tests/attention/test_swap.py::test_b[flash] FAILED          [ 50%]\n"
        "tests/attention/test_swap.py::test_c SKIPPED (no flash-attn) [ 75%]\n"
        "tests/compute/test_zero2.py::test_d "
    )
    assert module.main(["tests", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "quick_tests.json").read_text())
    assert (record["exit"], record["complete"]) == (None, False)
    swap, zero2 = record["files"]
    assert (swap["tests"], swap["passed"], swap["failed"], swap["skipped"]) == (3, 1, 1, 1)
    assert swap["problems"] == [{"test": "tests/attention/test_swap.py::test_b[flash]",
                                 "outcome": "failed", "message": ""}]  # fmt: skip
    assert (zero2["ran"], zero2["tests"]) == (False, 0)  # it hung in its first test


def test_the_summary_lists_each_part_and_the_records_it_did_not_leave(tmp_path: Path) -> None:
    module = load_module(SCRIPT)
    (tmp_path / "quick_device.json").write_text("{}")
    (tmp_path / "quick_parts.tsv").write_text(
        "device\t0\t8\t45\tquick_device.txt,quick_device.json\n"
        "hand\t124\t230\t230\tquick_hand_tuned_cuda.json\n"
        "attention\t\t\t4\tquick_attention_cuda.json\n"
    )
    assert module.main(["summary", str(tmp_path), "--setting", "STEPS=80"]) == 0
    summary = json.loads((tmp_path / "quick_summary.json").read_text())
    assert summary["settings"] == {"STEPS": "80"}
    device, hand, attention = summary["parts"]
    assert device["missing"] == ["quick_device.txt"]
    assert (hand["exit"], hand["timed_out"], hand["seconds"], hand["limit_s"]) == (
        124, True, 230, 230,
    )  # fmt: skip
    assert (attention["ran"], attention["limit_s"]) == (False, 4)
    assert (summary["passed"], summary["failed"], summary["not_run"]) == (
        ["device"], ["hand"], ["attention"],
    )  # fmt: skip
