"""bf16 on a CPU without native bf16 instructions: whether this machine is one, and the warning.

On Linux x86-64 with neither AVX512_BF16 nor AMX_BF16 (as torch reports them), oneDNN
emulates bf16, several times slower than float32. SpeedMonitor warns once at fit start
when a run trains in bf16 (mixed or true) on such a CPU.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

#: The x86 instructions that compute bf16 natively; with neither, oneDNN emulates bf16.
NATIVE_BF16_X86 = ("avx512_bf16", "amx_bf16")


def native_bf16(platform: str, capabilities: Mapping[str, Any] | None) -> bool | None:
    """Whether a CPU computes bf16 natively, from its platform (``sys.platform``) and the
    capabilities torch reports (``torch.cpu.get_capabilities()``).

    True or False on Linux x86-64, where bf16 autocast was measured both ways; None
    (unknown, so no warning) on another platform or architecture, or when the
    capabilities do not mention the instructions.

    Example::

        >>> native_bf16("linux", {"architecture": "x86_64", "avx512_bf16": False,
        ...                       "amx_bf16": False})
        False
        >>> native_bf16("darwin", {"architecture": "x86_64", "amx_bf16": True}) is None
        True
    """
    if not platform.startswith("linux") or capabilities is None:
        return None
    if capabilities.get("architecture") != "x86_64":
        return None
    if not any(flag in capabilities for flag in NATIVE_BF16_X86):
        return None
    return any(bool(capabilities.get(flag)) for flag in NATIVE_BF16_X86)


def cpuinfo_capabilities(cpuinfo: str, machine: str) -> dict[str, Any] | None:
    """What ``torch.cpu.get_capabilities()`` says of bf16, from Linux's ``/proc/cpuinfo``
    text and ``platform.machine()``: for a torch without that function. None when the
    text has no ``flags`` line."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags = set(value.split())
            return {"architecture": machine, **{f: f in flags for f in NATIVE_BF16_X86}}
    return None


def cpu_native_bf16() -> bool | None:
    """:func:`native_bf16` for this machine, from torch's public
    ``torch.cpu.get_capabilities()`` (read once by torch, then cached), or, on a torch
    without it, from ``/proc/cpuinfo``. Tests replace this function to take either branch
    on any machine."""
    query = getattr(torch.cpu, "get_capabilities", None)
    if query is None:
        try:
            text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
        except OSError:
            return None
        return native_bf16(sys.platform, cpuinfo_capabilities(text, platform.machine()))
    try:
        capabilities = query()
    except RuntimeError:  # a CPU torch's cpuinfo could not read
        return None
    return native_bf16(sys.platform, capabilities)


def emulated_bf16(
    device: torch.device, precision: str, native: Callable[[], bool | None] | None = None
) -> bool:
    """Whether a run on ``device`` in ``precision`` trains in bf16 on a CPU known to lack
    native bf16: ``native()`` (by default :func:`cpu_native_bf16`) says False; None,
    unknown, is not enough to warn.

    Example::

        >>> emulated_bf16(torch.device("cpu"), "bf16-mixed", native=lambda: False)
        True
        >>> emulated_bf16(torch.device("cpu"), "32-true", native=lambda: False)
        False
    """
    if device.type != "cpu" or not precision.startswith("bf16"):
        return False
    return (native or cpu_native_bf16)() is False


def bf16_on_cpu_message(precision: str) -> str:
    """The warning for a run in ``precision`` on a CPU that emulates bf16, with the fix."""
    return (
        f"SpeedMonitor: this run trains in {precision} on a CPU without native bf16 "
        f"instructions (no AVX512_BF16 or AMX_BF16), where bf16 is emulated and slower than "
        f"float32: on such a CPU (2 AVX2 cores), a training step of the kit's tiny example "
        f"VLM took 312 ms in bf16 autocast against 41 ms in float32, 8x slower "
        f"(benchmarks/cpu_step.py). Train in float32 on this CPU: "
        f"`Trainer(precision='32-true')`."
    )
