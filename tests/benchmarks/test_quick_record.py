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


def test_each_test_file_is_recorded_with_its_counts_or_why_it_has_none(tmp_path: Path) -> None:
    module = load_module(SCRIPT)
    (tmp_path / "quick_tests").mkdir()
    (tmp_path / "quick_tests" / "attention_test_swap.xml").write_text(JUNIT)
    (tmp_path / "quick_tests.tsv").write_text(
        "tests/attention/test_swap.py\t1\t12\t60\tquick_tests/attention_test_swap.xml\n"
        "tests/measure/test_flops.py\t124\t60\t60\tquick_tests/measure_test_flops.xml\n"
        "tests/compute/test_zero2.py\t\t\t\t\n"
    )
    assert module.main(["tests", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "quick_tests.json").read_text())
    swap, flops, zero2 = record["files"]
    assert {k: v for k, v in swap.items() if k != "problems"} == {
        "file": "tests/attention/test_swap.py", "exit": 1, "seconds": 12, "limit_s": 60,
        "timed_out": False, "ran": True,
        "tests": 4, "passed": 1, "failed": 1, "errors": 1, "skipped": 1,
    }  # fmt: skip
    assert swap["problems"] == [
        {"test": "tests.attention.test_swap::test_b", "outcome": "failed",
         "message": "AssertionError: reverted"},
        {"test": "tests.attention.test_swap::test_c", "outcome": "errors",
         "message": 'failed on setup with "OSError"'},
    ]  # fmt: skip
    # cut off by its limit: no report from pytest
    assert (flops["exit"], flops["timed_out"], flops["tests"], flops["passed"]) == (
        124, True, None, None,
    )  # fmt: skip
    # not started: the part's time was spent
    assert (zero2["exit"], zero2["ran"], zero2["seconds"], zero2["timed_out"]) == (
        None, False, None, False,
    )  # fmt: skip
    assert record["totals"] == {"tests": 4, "passed": 1, "failed": 1, "errors": 1, "skipped": 1,
                                "files_timed_out": 1, "files_not_run": 1}  # fmt: skip


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
