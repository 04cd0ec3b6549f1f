"""benchmarks/gpu_suite.sh runs on a CPU at a tiny size: a GPU session's minutes go to
measuring, not to finding a broken script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.sh"


def suite(stage: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    settings = {**os.environ, "PYTHON": sys.executable, "RESULTS": str(tmp_path / "results"),
                "WORK": str(tmp_path / "work"), **env}  # fmt: skip
    return subprocess.run(["bash", str(SCRIPT), *([stage] if stage else [])], env=settings,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_without_a_stage_it_says_its_stages_and_fails(tmp_path: Path) -> None:
    done = suite("", tmp_path)
    assert done.returncode == 2
    for stage in ("quick", "tests", "hand", "seeds", "swap", "all"):
        assert f"gpu_suite.sh {stage}" in done.stdout
    assert "set -uo" not in done.stdout  # the header only


@pytest.mark.slow
def test_the_hand_and_seeds_stages_write_their_results(demo_corpus: Path, tmp_path: Path) -> None:
    tiny = {"SIZE": "tiny", "PRECISION": "32-true", "ACCELERATOR": "cpu", "STEPS": "12",
            "BATCH": "8", "SEEDS": "1", "DATA_DIR": str(demo_corpus)}  # fmt: skip
    results = tmp_path / "results"
    for stage in ("hand", "seeds"):
        done = suite(stage, tmp_path, **tiny)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert f"== {stage}: exit 0" in done.stdout
        assert (results / f"gpu_suite_{stage}.log").stat().st_size > 0

    hand = json.loads((results / "hand_tuned_cpu.json").read_text())
    assert hand["complete"] is True
    assert list(hand["rounds"][0]) == ["plain", "kit", "hand"]
    assert hand["config"]["size"] == "tiny"
    assert hand["config"]["batch_size"] == 8
    assert all(run["steps"] == 12 for run in hand["rounds"][0].values())

    plain, kit = json.loads((results / "demo_cpu_seed1.json").read_text())
    assert (plain["run"], kit["run"]) == ("plain", "kit")
    assert plain["steps"] == kit["steps"] == 12
    assert kit["loss_start"] == pytest.approx(plain["loss_start"], rel=1e-5)  # one seed
    # seed 1 is not the hand stage's seed 0: another initialisation, another first loss
    assert plain["loss_start"] != hand["rounds"][0]["plain"]["loss_start"]
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["demo_seed1", "hand", "path"]
    assert not (results / "demo_cpu_seed2.json").exists()  # SEEDS chose seed 1 only


MARKED = """
import pytest

@pytest.mark.gpu
def test_passes():
    pass

@pytest.mark.gpu
def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.flash_attn
def test_skips():
    pytest.skip("no flash-attn here")

def test_unmarked_is_deselected():
    raise AssertionError("a CPU test: not selected")
"""

HANGS = """
import time
import pytest

@pytest.mark.gpu
def test_hangs():
    time.sleep(600)
"""


def test_quick_refuses_an_unknown_part_before_running_any(tmp_path: Path) -> None:
    done = suite("quick", tmp_path, QUICK_PARTS="device,benchmark")
    assert done.returncode == 2
    assert "QUICK_PARTS: unknown part 'benchmark'; choose from device hand tests" in done.stdout
    assert not (tmp_path / "results" / "quick_parts.tsv").exists()


def test_quick_parts_without_time_left_are_listed_as_not_run(tmp_path: Path) -> None:
    done = suite("quick", tmp_path, QUICK_PARTS="device hand", QUICK_BUDGET="9")
    assert done.returncode == 1
    assert "== quick device: not run" in done.stdout
    summary = json.loads((tmp_path / "results" / "quick_summary.json").read_text())
    assert [(p["name"], p["exit"], p["ran"]) for p in summary["parts"]] == [
        ("device", None, False),
        ("hand", None, False),
    ]
    assert summary["not_run"] == ["device", "hand"]
    assert summary["passed"] == summary["failed"] == []


def _test_files(tmp_path: Path) -> tuple[Path, Path]:
    files = tmp_path / "marked" / "test_marked.py", tmp_path / "hangs" / "test_hangs.py"
    for file, text in zip(files, (MARKED, HANGS), strict=True):
        file.parent.mkdir()
        file.write_text(text)
    return files


@pytest.mark.slow
def test_quick_runs_the_test_files_in_one_pytest_each_test_under_its_limit(
    tmp_path: Path,
) -> None:
    files = _test_files(tmp_path)
    done = suite("quick", tmp_path, QUICK_PARTS="tests", QUICK_TEST_TIMEOUT="6",
                 QUICK_TESTS=" ".join(map(str, files)))  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "results" / "quick_tests.json").read_text())
    assert (record["exit"], record["complete"]) == (1, True)
    marked, hangs = record["files"]
    assert (marked["file"], hangs["file"]) == tuple(map(str, files))
    counts = {k: marked[k] for k in ("tests", "passed", "failed", "errors", "skipped")}
    assert counts == {"tests": 3, "passed": 1, "failed": 1, "errors": 0, "skipped": 1}
    assert [p["test"].rsplit("::", 1)[-1] for p in marked["problems"]] == ["test_fails"]
    assert marked["problems"][0]["message"] == "AssertionError: one is not two"
    # The hanging test is stopped at its own limit (pytest-timeout); the run goes on.
    assert (hangs["tests"], hangs["failed"]) == (1, 1)
    assert "Timeout" in hangs["problems"][0]["message"]
    (part,) = json.loads((tmp_path / "results" / "quick_summary.json").read_text())["parts"]
    assert (part["name"], part["exit"], part["missing"]) == ("tests", 1, [])


@pytest.mark.slow
def test_a_tests_part_cut_off_keeps_the_outcomes_it_printed(tmp_path: Path) -> None:
    files = _test_files(tmp_path)
    done = suite("quick", tmp_path, QUICK_PARTS="tests", QUICK_TEST_TIMEOUT="600",
                 QUICK_BUDGET="25", QUICK_TESTS=" ".join(map(str, files)))  # fmt: skip
    assert done.returncode == 1
    record = json.loads((tmp_path / "results" / "quick_tests.json").read_text())
    assert (record["exit"], record["complete"]) == (None, False)  # pytest never ended
    marked, hangs = record["files"]
    assert {k: marked[k] for k in ("tests", "passed", "failed", "skipped")} == {
        "tests": 3, "passed": 1, "failed": 1, "skipped": 1}  # fmt: skip
    assert (hangs["ran"], hangs["tests"]) == (False, 0)
    assert record["totals"]["files_not_reached"] == 1
    (part,) = json.loads((tmp_path / "results" / "quick_summary.json").read_text())["parts"]
    assert (part["name"], part["timed_out"]) == ("tests", True)


@pytest.mark.slow
def test_the_quick_stage_writes_every_parts_record(demo_corpus: Path, tmp_path: Path) -> None:
    """The whole quick stage on a CPU at the tiny size: every part, its record, the summary."""
    marked = tmp_path / "gpu_tests" / "test_marked.py"
    marked.parent.mkdir()
    marked.write_text(MARKED.replace("assert 1 == 2", "assert 2 == 2"))
    tiny = {"SIZE": "tiny", "PRECISION": "32-true", "ACCELERATOR": "cpu", "STEPS": "12",
            "BATCH": "8", "RUNS": "plain", "SEQ": "128", "DATA_DIR": str(demo_corpus),
            "QUICK_TESTS": str(marked), "QUICK_SLACK": "6", "QUICK_BUDGET": "3000",
            "QUICK_ARCHIVE": str(tmp_path / "quick.tgz")}  # fmt: skip
    done = suite("quick", tmp_path, **tiny)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = tmp_path / "results"
    parts = ["device", "hand", "tests", "parity", "attention"]
    for name in parts:
        assert f"== quick {name}: exit 0 after" in done.stdout
        assert (results / f"quick_{name}.log").stat().st_size > 0

    summary = json.loads((results / "quick_summary.json").read_text())
    assert [p["name"] for p in summary["parts"]] == summary["passed"] == parts
    assert all(p["missing"] == [] and p["timed_out"] is False for p in summary["parts"])
    assert summary["settings"]["STEPS"] == "12"
    assert summary["settings"]["SEQ"] == "128"
    assert [p["limit_s"] for p in summary["parts"]] == [6 * 45, 6 * 230, 6 * 120, 6 * 90, 6 * 95]
    with tarfile.open(tmp_path / "quick.tgz") as archive:  # every record, in one file
        packed = {Path(name).name for name in archive.getnames()}
    assert {"quick_summary.json", "quick_tests.json", "quick_attention_cpu.json"} <= packed

    device = json.loads((results / "quick_device.json").read_text())
    assert (device["cuda_available"], device["devices"]) == (False, [])
    assert device["torch"] == torch.__version__
    assert (results / "quick_device.txt").exists()  # nvidia-smi's answer, or its absence

    hand = json.loads((results / "quick_hand_tuned_cpu.json").read_text())
    assert hand["complete"] is True
    assert (hand["config"]["size"], hand["config"]["precision"]) == ("tiny", "32-true")
    assert (hand["config"]["steps"], hand["config"]["batch_size"]) == (12, 8)
    assert list(hand["rounds"][0]) == ["plain"]
    assert hand["rounds"][0]["plain"]["steps"] == 12

    tests = json.loads((results / "quick_tests.json").read_text())
    assert tests["totals"] == {"tests": 3, "passed": 2, "failed": 0, "errors": 0, "skipped": 1,
                               "files_not_reached": 0}  # fmt: skip
    assert (tests["exit"], tests["complete"]) == (0, True)

    swap = json.loads((results / "quick_swap_training_cpu.json").read_text())
    assert swap["complete"] is True
    assert (swap["size"], swap["steps"], swap["batches"], swap["batch_size"]) == ("tiny", 5, 2, 8)
    assert [row["variant"] for row in swap["rows"]] == ["own", "math", "sdpa", "auto"]
    for row in swap["rows"][1:]:
        assert len(row["parity"]) == 4  # two vision blocks, two decoder blocks
        # a named backend is kept wherever it passes; "auto" also reverts where the own
        # forward timed faster, which a loaded machine decides (the CI once saw 0.87x)
        timed = [p for p in row["parity"] if p["reason"].startswith("own forward faster")]
        assert row["reverted"] == (len(timed) if row["variant"] == "auto" else 0)
        assert all(p["status"] == "active" for p in row["parity"] if p not in timed)

    attention = json.loads((results / "quick_attention_cpu.json").read_text())
    assert {row["seq_len"] for row in attention["attention"]} == {128}
    assert {row["head_dim"] for row in attention["attention"]} == {64, 128}
    assert [run["image_size"] for run in attention["end_to_end"]] == [32, 64]
    assert all(len(run["parity"]) == 4 for run in attention["end_to_end"])


def test_the_issue_parts_are_not_in_quicks_default_list(tmp_path: Path) -> None:
    """The default list stays within its budget: frozen and packing are asked for by name."""
    done = suite("quick", tmp_path, QUICK_BUDGET="9")
    assert done.returncode == 1
    summary = json.loads((tmp_path / "results" / "quick_summary.json").read_text())
    assert summary["not_run"] == ["device", "hand", "tests", "parity", "attention"]
    done = suite("quick", tmp_path, QUICK_PARTS="frozen,packing", QUICK_BUDGET="9",
                 ACCELERATOR="cpu", PACKING_BACKENDS="flex sdpa auto")  # fmt: skip
    summary = json.loads((tmp_path / "results" / "quick_summary.json").read_text())
    assert [(p["name"], p["ran"], p["results"]) for p in summary["parts"]] == [
        ("frozen", False, ["quick_frozen_tower_cpu.json"]),
        ("packing", False, [f"quick_packing_{b}_cpu.json" for b in ("flex", "sdpa", "auto")]),
    ]
    assert summary["settings"]["PACKING_BACKENDS"] == "flex sdpa auto"


@pytest.mark.slow
def test_the_quick_frozen_and_packing_parts_write_their_records(
    demo_corpus: Path, tmp_path: Path
) -> None:
    """Issues 36 and 37's GPU parts on a CPU at a tiny size: each record and the summary
    (packing with flex alone: each backend is a process of its own, and test_packing runs
    the others)."""
    packing = ("--steps 6 --docs-per-step 8 --max-len 64 --vocab 32 --dim 16 --layers 1 "
               "--heads 2 --warmup 2 --rounds 1")  # fmt: skip
    tiny = {"SIZE": "tiny", "PRECISION": "32-true", "ACCELERATOR": "cpu", "BATCH": "4",
            "DATA_DIR": str(demo_corpus), "QUICK_PARTS": "frozen packing",
            "FROZEN_SAMPLES": "8", "PACKING_ARGS": packing,
            "PACKING_BACKENDS": "flex"}  # fmt: skip
    done = suite("quick", tmp_path, **tiny)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = tmp_path / "results"
    summary = json.loads((results / "quick_summary.json").read_text())
    assert [(p["name"], p["exit"], p["limit_s"], p["results"], p["missing"])
            for p in summary["parts"]] == [
        ("frozen", 0, 150, ["quick_frozen_tower_cpu.json"], []),
        ("packing", 0, 105, ["quick_packing_flex_cpu.json"], []),
    ]  # fmt: skip
    settings = summary["settings"]
    assert (settings["FROZEN_SAMPLES"], settings["PACKING_ARGS"]) == ("8", packing)

    frozen = json.loads((results / "quick_frozen_tower_cpu.json").read_text())
    assert (frozen["device"], frozen["torch"]) == ("cpu", torch.__version__)
    assert (frozen["precision"], frozen["complete"]) == ("32-true", True)
    (row,) = frozen["rows"]
    assert (row["model"], row["samples"], row["batch_size"]) == ("vlm-tiny", 8, 4)
    assert (row["epochs"], row["timed_epochs"], row["rounds"]) == (4, 2, 2)
    assert len(frozen["progress"]) == 4  # plain and cached, 2 rounds
    # epoch 0 runs 8; epoch 1 verifies batch 1 (4 run) and serves batch 2; epochs 2-3 serve
    assert (row["misses"], row["hits"], row["inputs_skipped"]) == (12, 20, 20)
    assert (row["same_losses"], row["store_bytes"]) == (True, 8 * 16 * 64 * 4)

    record = json.loads((results / "quick_packing_flex_cpu.json").read_text())
    assert (record["device"], record["precision"], record["backend"]) == ("cpu", "32-true", "flex")
    assert record["complete"] is True
    assert (record["settings"]["dim"], record["settings"]["steps"]) == (16, 6)  # PACKING_ARGS
    arms = [row["arm"] for row in record["rows"]]
    assert arms == ["padded", "bucketed", "packed", "packed_ffd"]
    fallback = "sdpa (flex unavailable: FlexAttention has no backward on CPU)"
    assert all(row["attention_kernels"]["backends"] == [fallback] for row in record["rows"])
    assert all(row["loss_gap_to_padded"] <= 1e-5 for row in record["rows"][2:])
