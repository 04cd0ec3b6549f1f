"""The suite's two-rank launcher: each rank a fork of a warm interpreter, started as
Lightning starts the ranks it launches, and a failing rank ends the job with its output."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.multiprocess import REPO, clean_env, run_script
from tests.helpers.warm_ranks import WarmRanks, rank_env

RANK = """
import atexit, json, os, sys, time
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

out = Path(sys.argv[sys.argv.index("--out") + 1])
rank = int(os.environ.get("LOCAL_RANK", "0"))
if "--fail" in sys.argv and rank == 1:
    raise ValueError("rank 1 stops here")
if "--fail" in sys.argv:
    time.sleep(600)  # a peer left waiting, as in a collective
seen = {k: os.environ.get(k) for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR")}
seen.update(pid=os.getpid(), main=__name__, argv=sys.argv[1:], threads=torch.get_num_threads(),
            port=os.environ.get("MASTER_PORT"), mine=os.environ.get("MINE"),
            rank_zero_only=rank_zero_only.rank, numpy=float(np.random.rand()))
(out / f"rank{rank}.json").write_text(json.dumps(seen))
atexit.register(lambda: (out / f"exit{rank}").write_text("ran"))  # a normal interpreter exit
if "--sleep" in sys.argv:
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def warm() -> Iterator[WarmRanks]:
    server = WarmRanks(REPO, clean_env())
    yield server
    server.close()


def test_each_rank_is_a_process_of_its_own_with_a_launched_ranks_environment(
    warm: WarmRanks, tmp_path: Path
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**clean_env(), "MINE": "kept", "OMP_NUM_THREADS": "1"}
    code, _ = warm.run(script, ["--out", str(tmp_path), "-x"], env, 2, timeout=60)
    assert code == 0
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["LOCAL_RANK"], r["NODE_RANK"], r["WORLD_SIZE"]) for r in ranks] == [
        ("0", "0", "2"), ("1", "0", "2")]  # fmt: skip
    assert ranks[0]["port"] == ranks[1]["port"] is not None
    assert ranks[0]["pid"] != ranks[1]["pid"] != os.getpid()
    for rank in ranks:
        assert (rank["main"], rank["mine"]) == ("__main__", "kept")
        assert rank["argv"] == ["--out", str(tmp_path), "-x"]
        assert rank["threads"] == 1  # OMP_NUM_THREADS of the job, not of the server
    assert [r["rank_zero_only"] for r in ranks] == [0, 1]  # as Lightning reads it at import
    assert ranks[0]["numpy"] != ranks[1]["numpy"]  # seeded per process, as when fresh
    assert [(tmp_path / f"exit{r}").read_text() for r in range(2)] == ["ran", "ran"]


def test_a_wait_cut_short_ends_the_server_and_its_ranks(tmp_path: Path) -> None:
    """A test's timeout or Ctrl-C inside ``run``: the job's reply must not answer the next."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    server = WarmRanks(REPO, clean_env())

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    def when_both_sleep() -> None:
        """The interrupt once both ranks have written their record (and sleep): at a fixed
        8 s, a loaded machine had not yet started rank 1."""
        for _ in range(6000):  # 300 s, long before the job's 900
            if all(_record(tmp_path / f"rank{r}.json") for r in range(2)):
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGALRM)  # handled in the main thread, inside `run`

    previous = signal.signal(signal.SIGALRM, interrupt)
    watcher = threading.Thread(target=when_both_sleep, daemon=True)
    try:
        watcher.start()
        with pytest.raises(KeyboardInterrupt):
            server.run(script, ["--out", str(tmp_path), "--sleep"], clean_env(), 2, 900)
    finally:
        watcher.join()
        signal.signal(signal.SIGALRM, previous)
    assert not server.alive()
    pids = [json.loads((tmp_path / f"rank{r}.json").read_text())["pid"] for r in range(2)]
    for pid in pids:  # the sleeping ranks died with their server
        for _ in range(100):
            if not Path(f"/proc/{pid}").exists() or "Z" in _state(pid):
                break
            time.sleep(0.05)
        assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid)


def _record(path: Path) -> bool:
    """Whether a rank's record is written whole."""
    try:
        json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return False
    return True


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"


def test_a_failing_rank_ends_the_job_with_its_traceback(warm: WarmRanks, tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    code, output = warm.run(script, ["--out", str(tmp_path), "--fail"], clean_env(), 2, 120)
    assert code == 1
    assert "ValueError: rank 1 stops here" in output
    assert "ran past" not in output  # rank 0 was stopped GRACE s later, not at the timeout
    assert warm.alive()  # the server serves the next job


def test_one_rank_gets_no_distributed_environment() -> None:
    assert rank_env({"A": "1"}, 0, 1, 1234) == {"A": "1"}
    assert rank_env({"A": "1"}, 1, 2, 1234)["MASTER_PORT"] == "1234"


def test_run_script_fails_naming_the_script_and_showing_the_ranks_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tests.helpers.multiprocess.SCRIPTS", tmp_path)
    (tmp_path / "rank.py").write_text(RANK)
    with pytest.raises(AssertionError, match=r"rank\.py exited with 1(.|\n)*rank 1 stops here"):
        run_script("rank.py", tmp_path / "out", "--fail", timeout=60)
