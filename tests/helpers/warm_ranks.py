"""Start a test script's ranks as forks of one interpreter that has already imported torch.

A two-rank script run the usual way (``python script.py``, Lightning's launcher starting
rank 1 as a second ``python script.py``) spends most of its time importing: about 4.5 s
of ``import lightning`` per rank on a 2-core machine against well under a second of
training. The suite runs about sixty such jobs. Here one server process per test process
imports torch, Lightning and the kit once; each job forks one child per rank from it,
with the environment Lightning's launcher gives a rank it starts itself (``LOCAL_RANK``,
``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so Lightning sees
processes created for it, as under ``torchrun``, and each rank runs the script as
``__main__``. What is judged is unchanged: each rank's ``rank{N}.json``.

The server is ``python -m tests.helpers.warm_ranks``: a JSON request per line on stdin,
a JSON reply per line on stdout. A rank's output goes to a log file of its own, outside
the job's directory, and comes back with the reply. A rank that fails ends the job: the
others are stopped a few seconds later (a peer waiting in a collective would otherwise
wait for the job's whole timeout).
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import IO, Any

#: Seconds the other ranks get to finish after one rank failed.
GRACE = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(env: dict[str, str], rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment of one rank: what Lightning's launcher gives the ranks it starts."""
    if world_size == 1:
        return dict(env)
    return {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "0",
            "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)}  # fmt: skip


class WarmRanks:
    """The client: one server per test process, started on first use, ended with it."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self._server = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.warm_ranks"], cwd=cwd, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )  # fmt: skip

    def alive(self) -> bool:
        return self._server.poll() is None

    def run(
        self, script: Path, args: list[str], env: dict[str, str], world_size: int,
        timeout: float,
    ) -> tuple[int, str]:  # fmt: skip
        """Run the job; the exit code of the rank that failed first (0: every rank passed)
        and the ranks' output, rank 0's first."""
        with tempfile.TemporaryDirectory(prefix="ranks-") as logs_dir:  # not in out_dir
            request = {"script": str(script), "args": args, "logs": logs_dir, "env": env,
                       "world_size": world_size, "timeout": timeout}  # fmt: skip
            assert self._server.stdin is not None
            assert self._server.stdout is not None
            self._server.stdin.write(json.dumps(request) + "\n")
            self._server.stdin.flush()
            line = self._server.stdout.readline()
            if not line:
                raise RuntimeError(f"the warm-rank server ended (exit {self._server.poll()})")
            reply = json.loads(line)
            logs = "".join(
                f"--- rank {rank} ---\n"
                + Path(logs_dir, f"rank{rank}.log").read_text(errors="replace")
                for rank in range(world_size)
            )
        if reply["timed_out"]:
            logs += f"\n--- the job ran past its {timeout:.0f} s and was stopped ---"
        if reply["first_failed"] is not None:  # the cause, not a peer stopped after it
            return reply["codes"][reply["first_failed"]], logs
        return next((code for code in reply["codes"] if code != 0), 0), logs

    def close(self) -> None:
        if self._server.stdin is not None:
            self._server.stdin.close()
        try:
            self._server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._server.kill()


# -- the server ----------------------------------------------------------------------------


def _run_rank(script: str, args: list[str], env: dict[str, str], log: str) -> None:
    """In a forked child: become the rank (output, environment, argv) and run the script."""
    code = 1
    try:
        os.setpgid(0, 0)  # the rank and its loader workers: one group to stop
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.environ.clear()
        os.environ.update(env)
        if "OMP_NUM_THREADS" in env:  # read at import, in the server: apply it here
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(script)  # as `python script.py` puts it
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _stop(pids: dict[int, int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def _launch(request: dict[str, Any]) -> dict[str, Any]:
    world_size, port = int(request["world_size"]), free_port()
    pids: dict[int, int] = {}
    for rank in range(world_size):
        env = rank_env(request["env"], rank, world_size, port)
        log = os.path.join(request["logs"], f"rank{rank}.log")
        pid = os.fork()
        if pid == 0:
            _run_rank(request["script"], request["args"], env, log)
        pids[pid] = rank
    codes: dict[int, int] = {}
    deadline, timed_out = time.monotonic() + float(request["timeout"]), False
    failed_at: float | None = None
    first_failed: int | None = None
    while len(codes) < world_size:
        pid, status = os.waitpid(-1, os.WNOHANG)
        now = time.monotonic()
        if pid:
            rank = pids.pop(pid)
            codes[rank] = os.waitstatus_to_exitcode(status)
            if codes[rank] != 0 and failed_at is None:
                failed_at, first_failed = now, rank
            continue
        if now > deadline or (failed_at is not None and now > failed_at + GRACE):
            timed_out = now > deadline
            _stop(pids)
            for pid in list(pids):
                _, status = os.waitpid(pid, 0)
                codes[pids.pop(pid)] = os.waitstatus_to_exitcode(status)
            break
        time.sleep(0.02)
    return {"codes": [codes[rank] for rank in range(world_size)], "timed_out": timed_out,
            "first_failed": first_failed}  # fmt: skip


def serve(requests: IO[str], replies: IO[str]) -> None:
    # What every rank would import first; imported once, here, before any fork.
    import lightning  # noqa: F401
    import torch.distributed  # noqa: F401

    import lightning_speedkit  # noqa: F401
    import tests.helpers.multiprocess  # noqa: F401

    for line in requests:
        replies.write(json.dumps(_launch(json.loads(line))) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve(sys.stdin, sys.stdout)
