"""Run a multi-process training script as its own program, and collect what each rank wrote.

Lightning's default subprocess launcher re-executes ``sys.argv``: inside pytest that
would re-run the whole test session on rank 1. So a multi-process test puts its job
in a script under ``tests/scripts``, and this helper runs that script in a fresh
interpreter with a clean environment. Each rank writes ``rank{N}.json`` to the
output directory before it exits; the test judges those files.

About 2% of two-process gloo runs abort at interpreter exit, after training
finished correctly, with "terminate called without an active exception" or (more
rarely) "terminate called after throwing an instance of 'std::system_error' /
Resource deadlock avoided" from gloo's threads; a run that fails with exactly one
of those signatures is retried once. Any other failure is reported with
the script's output.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers.warm_ranks import WarmRanks

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
REPO = SCRIPTS.parent.parent
_EXIT_ABORTS = (
    "terminate called without an active exception",
    "what():  Resource deadlock avoided",
)
_DIST_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
)


def clean_env() -> dict[str, str]:
    """This process's environment without distributed or Lightning launcher variables.

    The repository root goes first on PYTHONPATH, so scripts can import ``tests.helpers``.
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _DIST_VARS and not k.startswith(("PL_", "TORCHELASTIC_"))
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_script(
    script: str, out_dir: Path, *args: str, world_size: int = 2, timeout: float = 300,
    fresh: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """Run ``tests/scripts/<script>`` with ``--out DIR`` and return each rank's results.

    The ranks are forks of a warm interpreter (:mod:`tests.helpers.warm_ranks`), started
    as Lightning starts the ranks it launches; ``fresh=True`` (or the environment
    variable ``SPEEDKIT_TEST_FRESH_RANKS=1`` for every run) runs ``python script.py``
    instead, with Lightning's own launcher starting rank 1, as a user's job does. A
    script that launches its ranks itself (``--launcher``) and CUDA runs are always fresh.
    """
    args = ("--out", str(out_dir), *args)
    on_gpu = any(arg.rpartition("=")[2] in ("cuda", "gpu") for arg in args)  # not a path's
    warm = not (fresh or on_gpu or "--launcher" in args
                or os.environ.get("SPEEDKIT_TEST_FRESH_RANKS") == "1")  # fmt: skip
    for attempt in range(2):
        for stale in out_dir.glob("rank*.json"):
            stale.unlink()
        if warm:
            code, output = _warm_ranks().run(SCRIPTS / script, list(args), clean_env(),
                                             world_size, timeout)  # fmt: skip
        else:
            code, output = _fresh_interpreter(SCRIPTS / script, args, timeout)
        if code == 0:
            break
        if attempt == 0 and any(abort in output for abort in _EXIT_ABORTS):
            continue
        raise AssertionError(f"{script} exited with {code}\n{output[-12000:]}")
    results = []
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.json"
        if not path.exists():
            raise AssertionError(f"{script}: rank {rank} wrote no results\n{output[-8000:]}")
        results.append(json.loads(path.read_text()))
    return results


def _python(
    script: Path, args: tuple[str, ...], timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python script.py ARGS``: Lightning's launcher starts the other ranks."""
    return subprocess.run([sys.executable, str(script), *args], env=clean_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip


def _fresh_interpreter(script: Path, args: tuple[str, ...], timeout: float) -> tuple[int, str]:
    proc = _python(script, args, timeout)
    return proc.returncode, f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"


_SERVER: WarmRanks | None = None


def _warm_ranks() -> WarmRanks:
    """This test process's warm-rank server, started on first use; started again when it
    died or when the environment changed (what a rank reads at import, it read then)."""
    global _SERVER
    env = clean_env()
    if _SERVER is not None and (not _SERVER.alive() or _SERVER.env != env):
        _SERVER.close()
        _SERVER = None
    if _SERVER is None:
        _SERVER = WarmRanks(REPO, env)
    return _SERVER


@atexit.register
def _close_server() -> None:
    if _SERVER is not None:
        _SERVER.close()


def run_script_failing(
    script: str, out_dir: Path, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``tests/scripts/<script>`` with ``--out DIR``, a job meant to end with an error.

    Returns the finished process (its exit status and output) for the test to judge; a
    job that exits with 0 is an AssertionError. The call returns once every rank has
    closed its output, so what the ranks wrote before exiting is on disk.
    """
    proc = _python(SCRIPTS / script, ("--out", str(out_dir), *args), timeout)
    if proc.returncode == 0:
        raise AssertionError(
            f"{script} was meant to fail and exited with 0\n--- stdout ---\n"
            f"{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
    return proc


def finish_rank(out_dir: Path, rank: int, result: dict[str, Any]) -> None:
    """In a script: write this rank's results, then leave the process group cleanly."""
    import torch.distributed as dist

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
