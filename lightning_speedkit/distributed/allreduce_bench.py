"""bench_allreduce: all-reduce time and bandwidth over message sizes, as nccl-tests reports them.

For each size: ``iters`` timed all-reduces after ``warmup`` untimed ones, on
``world_size`` local processes. The time is the slowest rank's mean (a
collective is as slow as its slowest member). Bandwidths follow nccl-tests:

- algorithm bandwidth ``algbw = bytes / time``;
- bus bandwidth ``busbw = algbw * 2 (n - 1) / n``: what each link carried in a
  ring all-reduce, comparable across world sizes and with the hardware's peak.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["AllReduceResult", "bench_allreduce", "parse_size"]

_UNITS = {"B": 1, "KB": 2**10, "KIB": 2**10, "MB": 2**20, "MIB": 2**20, "GB": 2**30, "GIB": 2**30}


@dataclass(frozen=True)
class AllReduceResult:
    """One message size: bytes, mean time of the slowest rank, and bandwidths in GB/s (1e9 B/s)."""

    backend: str
    world_size: int
    bytes: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float


def parse_size(text: str) -> int:
    """``"64KB"`` -> 65536; units B, KB, MB, GB (powers of 2); a bare number is bytes.

    Example::

        >>> parse_size("64KB"), parse_size("1.5MB"), parse_size("512")
        (65536, 1572864, 512)
    """
    cleaned = text.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if cleaned.endswith(unit):
            number = cleaned[: -len(unit)]
            break
    else:
        unit, number = "B", cleaned
    try:
        value = int(float(number) * _UNITS[unit])
    except ValueError:
        raise SpeedkitConfigError(
            f"Cannot read the size {text!r}; write e.g. 4KB, 16MB or 1GB."
        ) from None
    if value < 4:
        raise SpeedkitConfigError(f"A message of {text!r} is smaller than one float32 (4 bytes).")
    return value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int, world_size: int, backend: str, port: int, sizes: list[int], iters: int,
    warmup: int, out: str,
) -> None:  # fmt: skip
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows = []
    try:
        for size in sizes:
            tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
            for _ in range(warmup):
                dist.all_reduce(tensor)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # SYNC: benchmark timing
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(tensor)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # SYNC: benchmark timing
            elapsed = torch.tensor([(time.perf_counter() - start) / iters], device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            rows.append((size, float(elapsed.item())))
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()


def bench_allreduce(
    backend: str = "gloo",
    world_size: int = 2,
    sizes: list[int] | None = None,
    iters: int = 20,
    warmup: int = 5,
) -> list[AllReduceResult]:
    """Time all-reduce of float32 messages on ``world_size`` local processes.

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per process).
        world_size: processes (>= 2).
        sizes: message sizes in bytes; default 4 KB to 64 MB by factors of 4.
        iters: timed all-reduces per size.
        warmup: untimed all-reduces per size first.

    ``speedkit bench-allreduce`` prints its rows with :func:`format_table`.
    """
    if backend not in ("gloo", "nccl"):
        raise SpeedkitConfigError(f"`backend` must be 'gloo' or 'nccl', got {backend!r}.")
    if world_size < 2:
        raise SpeedkitConfigError(
            f"`world_size` must be at least 2 for an all-reduce, got {world_size}."
        )
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise SpeedkitConfigError(
            f"`backend`='nccl' needs one GPU per process: {world_size} asked, "
            f"{torch.cuda.device_count()} visible. Use --backend gloo or fewer processes."
        )
    if iters < 1 or warmup < 0:
        raise SpeedkitConfigError(
            f"`iters` must be >= 1 and `warmup` >= 0, got {iters} and {warmup}."
        )
    sizes = sizes or [4 * 2**10 * 4**k for k in range(8)]  # 4 KB ... 64 MB
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.pt")
        mp.spawn(  # type: ignore[attr-defined]
            _worker, args=(world_size, backend, _free_port(), sizes, iters, warmup, out),
                 nprocs=world_size, join=True)  # fmt: skip
        rows: list[tuple[int, float]] = torch.load(out, weights_only=True)
    results = []
    for size, seconds in rows:
        algbw = size / seconds / 1e9
        results.append(AllReduceResult(backend, world_size, size, seconds * 1e6, algbw,
                                       algbw * 2 * (world_size - 1) / world_size))  # fmt: skip
    return results


def format_table(results: list[AllReduceResult]) -> str:
    first = results[0]
    lines = [
        f"all-reduce, float32, {first.backend}, {first.world_size} processes "
        f"(busbw = algbw x 2(n-1)/n, as nccl-tests)",
        f"{'size':>10}  {'time (us)':>12}  {'algbw (GB/s)':>13}  {'busbw (GB/s)':>13}",
    ]
    for r in results:
        row = f"{_human(r.bytes):>10}  {r.time_us:>12.1f}  {r.algbw_gbps:>13.3f}"
        lines.append(f"{row}  {r.busbw_gbps:>13.3f}")
    return "\n".join(lines)


def _human(size: int) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


def to_json(results: list[AllReduceResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]
