"""The memory a micro-batch trial may use, and the memory it used.

The limit is what the process holds when tuning starts plus ``1 - memory_headroom`` of
what is free, less what training will add that a trial does not (optimizer states);
the peak is the device allocator's on CUDA and the resident set's on CPU (Linux
``/proc``). Elsewhere both are unknown (None).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_speedkit._optimizers import torch_optimizer

__all__ = ["GIB", "PeakMemory", "memory_limit", "optimizer_state_bytes", "out_of_memory"]

GIB = 2**30


def _proc_kib(path: str, key: str) -> int | None:
    """A ``key: N kB`` line of a /proc file, in KiB; None where it cannot be read."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_limit(
    device: torch.device | str, memory_headroom: float = 0.1, reserve_bytes: int = 0
) -> int | None:
    """The peak memory a trial step may reach on ``device``, in bytes; None if unknown.

    What the process holds now, plus ``1 - memory_headroom`` of what is free, less
    ``reserve_bytes`` (memory training will add that a trial does not). On CUDA in
    the allocator's terms (``max_memory_allocated``); on CPU in the resident set's
    (Linux ``/proc``).

    Example::

        >>> limit = memory_limit("cpu", memory_headroom=0.5)
        >>> limit is None or limit > 0
        True
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        spare = torch.cuda.memory_reserved(device) - allocated  # the caching allocator's
        return int(allocated + (1 - memory_headroom) * (free + spare)) - reserve_bytes
    if device.type == "cpu":
        held = _proc_kib("/proc/self/status", "VmRSS")
        available = _proc_kib("/proc/meminfo", "MemAvailable")
        if held is None or available is None:
            return None
        return int(1024 * (held + (1 - memory_headroom) * available)) - reserve_bytes
    return None


class PeakMemory:
    """The peak memory of a stretch of work: the allocator's on CUDA, the resident set's on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu":
            with contextlib.suppress(OSError):  # without it VmHWM is the process's peak so far
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)

    def read(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.device.type == "cpu":
            peak = _proc_kib("/proc/self/status", "VmHWM")
            return None if peak is None else 1024 * peak
        return None


def out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError, Python's MemoryError, or the RuntimeError torch raises
    elsewhere for the same (the CPU allocator's "can't allocate memory", an older CUDA's
    "out of memory")."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower()
    )


def optimizer_state_bytes(optimizers: Sequence[Any]) -> int:
    """Bytes of optimizer state not created yet (torch creates it at the first step).

    Two tensors the size of each parameter (Adam's moments), one for SGD with
    momentum, Adagrad and RMSprop, none for plain SGD: an estimate, for the memory
    limit only.
    """
    total = 0
    for wrapped in optimizers:
        optimizer = torch_optimizer(wrapped)
        if optimizer is None:
            continue
        name = type(optimizer).__name__
        for group in optimizer.param_groups:
            if name == "SGD":
                per = 1 if group.get("momentum") else 0
            elif name in ("Adagrad", "RMSprop"):
                per = 1
            else:
                per = 2
            for p in group["params"]:
                if not optimizer.state.get(p):
                    total += per * p.numel() * p.element_size()
    return total
