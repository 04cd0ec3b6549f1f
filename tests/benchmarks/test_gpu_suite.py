"""benchmarks/gpu_suite.sh runs on a CPU at a tiny size: a GPU session's minutes go to
measuring, not to finding a broken script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.sh"


def suite(stage: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    settings = {**os.environ, "PYTHON": sys.executable, "RESULTS": str(tmp_path / "results"),
                "WORK": str(tmp_path / "work"), **env}  # fmt: skip
    return subprocess.run(["bash", str(SCRIPT), *([stage] if stage else [])], env=settings,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_without_a_stage_it_says_its_stages_and_fails(tmp_path: Path) -> None:
    done = suite("", tmp_path)
    assert done.returncode == 2
    for stage in ("tests", "hand", "seeds", "swap", "all"):
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
