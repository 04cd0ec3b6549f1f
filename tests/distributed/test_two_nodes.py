"""Two nodes of one process each, in two network namespaces joined by a veth pair.

The job is launched the way a cluster launches it: one command per node, started in
that node's namespace, first with the variables Lightning reads for ``num_nodes=2``
(``MASTER_ADDR`` = node 0's address on the link, ``MASTER_PORT``, ``NODE_RANK``,
``LOCAL_RANK``), then resumed with ``torchrun --nnodes=2 --node-rank=R``. Each namespace
holds only its end of the veth and a loopback, so every byte the ranks exchange
crosses the link, and gloo is told to use it (``GLOO_SOCKET_IFNAME``). Needs root and
``ip netns``; skipped with the reason elsewhere.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.modules import load_module
from tests.helpers.multiprocess import REPO, SCRIPTS, clean_env

netns = load_module(REPO / "benchmarks" / "netns_link.py")
SCRIPT = SCRIPTS / "two_nodes_vlm.py"
_EXIT_ABORTS = (  # gloo's threads at interpreter exit, after the results are written
    "terminate called without an active exception",
    "what():  Resource deadlock avoided",
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _launch(link: Any, launcher: str, port: int, out: Path, *args: str) -> list[dict[str, Any]]:
    """Start one process per node, each in its namespace; return what each rank wrote."""
    for attempt in range(2):
        shutil.rmtree(out, ignore_errors=True)  # nothing left from a failed first attempt
        out.mkdir(parents=True)
        procs, logs = [], []
        for node in (0, 1):
            script = [str(SCRIPT), "--out", str(out), *args]
            env = link.node_env(node, port + attempt, base=clean_env())
            env["OMP_NUM_THREADS"] = "1"  # else Lightning gives each "node" every core of this one
            if launcher == "torchrun":
                for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK"):
                    del env[name]  # torchrun sets them for its worker from its flags
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                       "--nproc-per-node=1", f"--node-rank={node}",
                       f"--master-addr={link.addresses[0]}", f"--master-port={port + attempt}",
                       *script]  # fmt: skip
            else:
                cmd = [sys.executable, *script]
            log = out / f"node{node}-{launcher}.log"
            logs.append(log)
            with log.open("w") as sink:  # a file, not a pipe: a full pipe stalls a collective
                procs.append(subprocess.Popen(link.command(node, cmd), env=env, stdout=sink,
                                              stderr=subprocess.STDOUT,
                                              start_new_session=True))  # fmt: skip
        codes = _wait(procs, timeout=150)
        text = "\n".join(f"--- {log.name} ---\n{log.read_text()[-6000:]}" for log in logs)
        if codes == [0, 0]:
            break
        if attempt == 0 and any(abort in text for abort in _EXIT_ABORTS):
            continue
        raise AssertionError(f"{launcher} launch exited with {codes}\n{text}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int | None]:
    """Exit codes; once one node has failed the other gets 20 s, then both are ended.

    (torchrun's agent on the other node would otherwise wait for the failed one at its
    exit barrier for minutes.) Ended processes read as None.
    """
    deadline = time.monotonic() + timeout
    ended: set[int] = set()
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode for p in procs):
                deadline = min(deadline, time.monotonic() + 20)
            time.sleep(0.1)
    finally:
        for node, p in enumerate(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # this launch and its children (torchrun's)
                p.wait()
                ended.add(node)
    return [None if node in ended else p.returncode for node, p in enumerate(procs)]


def _params(out: Path, rank: int) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = torch.load(out / f"params{rank}.pt", weights_only=True)
    return loaded


@pytest.fixture
def link() -> Any:
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"two nodes need network namespaces: {reason}")
    veth = netns.VethLink(f"sk2n{os.getpid() % 100_000}", subnet="10.232.0")
    try:  # deleted also when the test fails or is interrupted
        veth.create()
        yield veth
    finally:
        veth.delete()
        assert not any(ns in _namespaces() for ns in veth.namespaces)


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_vlm_trains_on_two_nodes_with_powersgd_and_resumes_exactly_under_torchrun(
    link: Any, small_corpus: Path, tmp_path: Path
) -> None:
    data = ["--data-dir", str(small_corpus), "--steps", "8", "--start-iter", "2"]
    whole = _launch(link, "lightning", 29_500, tmp_path / "whole", *data, "--save-every", "4")

    for rank, result in enumerate(whole):
        assert result["global_rank"] == result["node_rank"] == rank  # one process per node
        assert (result["world_size"], result["num_nodes"]) == (2, 2)
        assert result["environment"] == "LightningEnvironment"
        assert result["main_address"] == link.addresses[0]
        assert result["backend"] == "gloo"
        assert result["global_step"] == 8
        assert len(result["losses"]) == 8
        assert result["powersgd_iter"] == 8
        assert result["ratio"] > 1  # PowerSGD compressed, from iteration 2 on
    # Data parallel: the ranks saw different batches and ended with the same weights.
    assert whole[0]["losses"] != whole[1]["losses"]
    final = _params(tmp_path / "whole", 0)
    assert all(torch.equal(final[k], v) for k, v in _params(tmp_path / "whole", 1).items())

    # Gloo's traffic went over the veth: the two plain all-reduce steps sent each rank's
    # whole fp32 gradient across it; compressed steps sent a fraction of that.
    grad = whole[0]["grad_bytes"]
    for result in whole:
        wire = result["wire"]
        sent = [b[0] - a[0] for a, b in itertools.pairwise(wire)]
        received = [b[1] - a[1] for a, b in itertools.pairwise(wire)]
        assert min(sent[:2]) >= grad
        assert min(received[:2]) >= grad
        assert max(sent[5:]) < grad / 2  # steps 6-8 (step 4 also gathered PowerSGD's state)
        assert wire[-1][0] - wire[0][0] >= 2 * grad

    checkpoint = tmp_path / "whole" / "ckpt" / "epoch=0-step=4.ckpt"
    saved = torch.load(checkpoint, weights_only=True)["callbacks"]["DDPPowerSGDStrategy"]
    assert saved["world_size"] == 2
    assert [rank["iter"] for rank in saved["ranks"]] == [4, 4]

    resumed = _launch(link, "torchrun", 29_600, tmp_path / "resumed", *data,
                      "--resume", str(checkpoint))  # fmt: skip
    for rank, result in enumerate(resumed):
        assert result["environment"] == "TorchElasticEnvironment"
        assert result["global_rank"] == result["node_rank"] == rank
        assert result["global_step"] == 8
        assert result["powersgd_iter"] == 8
        assert result["losses"] == whole[rank]["losses"][4:]  # exactly the uninterrupted run's
        params = _params(tmp_path / "resumed", rank)
        assert all(torch.equal(final[k], v) for k, v in params.items())
