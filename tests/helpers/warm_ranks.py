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

import atexit
import contextlib
import ctypes
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from lightning.fabric.plugins.environments.lightning import find_free_network_port

#: Seconds the other ranks get to finish after one rank failed.
GRACE = 5.0
#: prctl's PR_SET_PDEATHSIG: the signal a process gets when its parent dies.
_PR_SET_PDEATHSIG = 1


def rank_env(env: dict[str, str], rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment of one rank: what Lightning's launcher gives the ranks it starts."""
    if world_size == 1:
        return dict(env)
    return {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "0",
            "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)}  # fmt: skip


class WarmRanks:
    """The client: a server started with ``env``, for jobs run with that environment."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.env = dict(env)
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
        and the ranks' output, rank 0's first.

        Anything that interrupts the wait (a test's timeout, Ctrl-C) ends the server and
        its ranks: a reply left unread would answer the next job.
        """
        with tempfile.TemporaryDirectory(prefix="ranks-") as logs_dir:  # not in out_dir
            request = {"script": str(script), "args": args, "logs": logs_dir, "env": env,
                       "world_size": world_size, "timeout": timeout}  # fmt: skip
            try:
                reply = self._ask(request)
            except BaseException:
                self._server.kill()  # its ranks die with it (their parent-death signal)
                self._server.wait()
                raise
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

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._server.stdin is not None
        assert self._server.stdout is not None
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        line = self._server.stdout.readline()
        if not line:
            raise RuntimeError(f"the warm-rank server ended (exit {self._server.wait(5)})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close(self) -> None:
        if self._server.stdin is not None:
            self._server.stdin.close()
        try:
            self._server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()


# -- the server ----------------------------------------------------------------------------


class _Rank(BaseException):
    """Raised in a forked child: unwinds it out of the server's loop to run as a rank."""

    def __init__(self, script: str, args: list[str], env: dict[str, str], log: str) -> None:
        super().__init__()
        self.script, self.args, self.env, self.log = script, args, env, log


def _become_rank(rank: _Rank, server: int) -> None:
    """In a forked child: the rank's process group, output, environment and argv."""
    os.setpgid(0, 0)  # the rank and its loader workers: one group to stop
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server:  # the server died before the line above
        os._exit(1)
    fd = os.open(rank.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.dup2(null, 0)
    os.close(fd)
    os.close(null)
    os.environ.clear()
    os.environ.update(rank.env)
    # What a fresh interpreter would have read or drawn for itself at start.
    import numpy as np
    import torch
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    np.random.seed()
    rank_zero_only.rank = int(rank.env.get("LOCAL_RANK", "0"))
    if "OMP_NUM_THREADS" in rank.env:  # read at import, in the server: apply it here
        torch.set_num_threads(int(rank.env["OMP_NUM_THREADS"]))
    sys.argv = [rank.script, *rank.args]
    sys.path[0] = os.path.dirname(rank.script)  # as `python script.py` puts it


def _stop(pids: Iterable[int]) -> None:
    for pid in pids:  # each rank leads its own process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def _launch(request: dict[str, Any]) -> dict[str, Any]:
    """Fork the job's ranks (a child raises :class:`_Rank`), wait for them, stop leftovers."""
    world_size, port = int(request["world_size"]), find_free_network_port()
    server, pids = os.getpid(), {}
    try:
        for rank in range(world_size):
            env = rank_env(request["env"], rank, world_size, port)
            log = os.path.join(request["logs"], f"rank{rank}.log")
            pid = os.fork()
            if pid == 0:
                raise _Rank(request["script"], request["args"], env, log) from None
            pids[pid] = rank
        return _wait(dict(pids), float(request["timeout"]))
    finally:
        if pids and os.getpid() == server:  # the server (a child leaves its siblings be)
            _stop(pids)  # a rank's loader workers left behind, or ranks of a failed fork


def _wait(pids: dict[int, int], timeout: float) -> dict[str, Any]:
    world_size, codes = len(pids), {}
    deadline, timed_out = time.monotonic() + timeout, False
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
    import numpy  # noqa: F401
    import torch.distributed  # noqa: F401

    import lightning_speedkit  # noqa: F401
    import tests.helpers.multiprocess  # noqa: F401

    for line in requests:
        replies.write(json.dumps(_launch(json.loads(line))) + "\n")
        replies.flush()


def _main() -> int:
    """The server, or, in a forked child, a rank: run as ``__main__``, ended as
    ``python script.py`` ends (non-daemon threads joined, atexit handlers run, output
    flushed) less the teardown of every module, about a second of the interpreter's own
    work per rank here."""
    server = os.getpid()
    # Replies go to a descriptor of their own; anything printed goes to stderr, so a
    # library that prints on import cannot corrupt the protocol.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        serve(sys.stdin, replies)
        return 0
    except _Rank as raised:
        rank = raised
    replies.close()  # the server's end of the protocol: not a rank's
    _become_rank(rank, server)
    code = _run_script(rank.script)
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx does first,
    atexit._run_exitfuncs()  # then this
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _run_script(script: str) -> int:
    """The script as ``__main__``; its exit code as the interpreter would give it."""
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)  # sys.exit("message"): said, and exit 1
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
