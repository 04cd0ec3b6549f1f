"""Two "nodes" on one machine: two network namespaces joined by a veth pair.

Shared by the benchmarks that need a real network link between ranks
(``comm_bandwidth.py``, ``ddp_buckets.py``) and by the two-node test
(``tests/distributed/test_two_nodes.py``). Each namespace holds one end of the
pair and its loopback, nothing else, so a process started in it with
:meth:`VethLink.command` can reach only the other namespace: every byte ranks
exchange crosses the veth, whose rate :meth:`VethLink.shape` limits with tc's
token-bucket filter (tbf; netem, for delay and loss, is not on every kernel).

Needs root and iproute2 (``ip``, ``tc``). Use it as a context manager, so the
namespaces are deleted also when the job fails:

    with VethLink("speedkit") as link:
        link.shape("1gbit")
        env = link.node_env(0, port=29500)        # Lightning's variables for num_nodes=2
        subprocess.run(link.command(0, [sys.executable, "train.py"]), env=env)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

#: Variables a launcher sets; removed from a node's environment before its own are set.
DIST_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
)


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def ensure_iproute2() -> None:
    """Install iproute2 with apt-get when ``ip`` or ``tc`` is missing (benchmarks only)."""
    if shutil.which("ip") and shutil.which("tc"):
        return
    _sh("apt-get", "update")
    _sh("apt-get", "install", "-y", "iproute2")


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can (without installing)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "creating network namespaces needs root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (`ip`, `tc`) is not installed"
    probe = f"speedkit_probe{os.getpid()}"
    made = _sh("ip", "netns", "add", probe, check=False)
    _sh("ip", "netns", "delete", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    return None


def clean_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) without launcher variables."""
    return {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if k not in DIST_VARS and not k.startswith(("PL_", "TORCHELASTIC_"))
    }


class VethLink:
    """Namespaces ``{tag}_ns0`` and ``{tag}_ns1``, veths ``{tag}_v0``/``{tag}_v1`` between them.

    Args:
        tag: prefix of every name; at most 12 characters (an interface name has 15).
            Two links with different tags can exist side by side.
        subnet: first three octets of the /24 the two ends take (``.1`` and ``.2``).
            The addresses exist only inside the two namespaces.
    """

    def __init__(self, tag: str, subnet: str = "10.231.0") -> None:
        if not 0 < len(tag) <= 12 or not tag.replace("_", "").isalnum():
            raise ValueError(f"`tag` must be 1-12 letters, digits or '_', got {tag!r}.")
        self.namespaces = (f"{tag}_ns0", f"{tag}_ns1")
        self.interfaces = (f"{tag}_v0", f"{tag}_v1")
        self.addresses = (f"{subnet}.1", f"{subnet}.2")

    def create(self) -> None:
        """Make both namespaces (deleting leftovers of the same names first) and the veth."""
        self.delete()
        for ns in self.namespaces:
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "link", "add", self.interfaces[0], "netns", self.namespaces[0], "type", "veth",
            "peer", "name", self.interfaces[1], "netns", self.namespaces[1])  # fmt: skip
        for ns, dev, addr in zip(self.namespaces, self.interfaces, self.addresses, strict=True):
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")

    def shape(self, rate: str) -> None:
        """Limit both directions to ``rate`` (tc syntax: ``"1gbit"``, ``"10gbit"``)."""
        for ns, dev in zip(self.namespaces, self.interfaces, strict=True):
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", rate, "burst", "256kb", "latency", "50ms")  # fmt: skip

    def delete(self) -> None:
        """Delete both namespaces (and with them the veth); no error if they are gone."""
        for ns in self.namespaces:
            _sh("ip", "netns", "delete", ns, check=False)

    def command(self, node: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node], *cmd]

    def node_env(
        self, node: int, port: int, base: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """The environment Lightning reads for ``num_nodes=2, devices=1`` on node ``node``.

        Lightning's default ``LightningEnvironment`` takes the processes as launched
        from outside when ``LOCAL_RANK`` is set, and reads ``MASTER_ADDR``,
        ``MASTER_PORT`` and ``NODE_RANK``; gloo binds to ``GLOO_SOCKET_IFNAME``.
        """
        env = clean_env(base)
        env.update(
            MASTER_ADDR=self.addresses[0],
            MASTER_PORT=str(port),
            WORLD_SIZE="2",
            NODE_RANK=str(node),
            LOCAL_RANK="0",
            GLOO_SOCKET_IFNAME=self.interfaces[node],
        )
        return env

    def __enter__(self) -> VethLink:
        self.create()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.delete()


def interface_bytes(interface: str) -> tuple[int, int]:
    """(sent, received) bytes of ``interface``, as seen from the namespace this runs in."""
    stats = Path("/sys/class/net") / interface / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def exit_on_sigterm() -> None:
    """Let SIGTERM (e.g. from ``timeout``) unwind, so that ``finally`` deletes the namespaces."""
    import signal

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(f"terminated by signal {signum}")

    signal.signal(signal.SIGTERM, handler)
