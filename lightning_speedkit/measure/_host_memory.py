"""The host memory this process holds, read the way each operating system allows.

SpeedMonitor's ``mem_peak_gib`` on a CPU run samples this figure at each log and
keeps the largest. Each platform has its own source, and its own unit:

- Linux: the resident set now, from ``/proc/self/statm`` (pages). Where ``/proc``
  cannot be read, the process's peak resident set, ``ru_maxrss`` (KiB on Linux).
- macOS: the resident set now through psutil when it is installed, otherwise the
  process's peak resident set, ``ru_maxrss``, which macOS reports in bytes.
- Windows: the working set now, through psutil when it is installed, otherwise
  ``GetProcessMemoryInfo`` through ctypes. Windows has no ``resource`` module.
- Anything else: psutil when it is installed, otherwise unknown (None), never a
  number in a guessed unit.

Nothing here is imported at module level beyond the standard library's always-present
modules, so importing the kit works on every platform.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["host_memory_bytes"]

#: Linux's per-process memory figures in pages: size, resident, shared, ...
_STATM = "/proc/self/statm"


def host_memory_bytes() -> int | None:
    """Host memory held by this process, in bytes; None where the platform tells nothing.

    The resident set (working set on Windows) now, except on macOS without psutil
    and on Linux without ``/proc``, where it is the process's peak so far.

    Example::

        >>> held = host_memory_bytes()
        >>> held is None or held > 0
        True
    """
    platform = sys.platform
    if platform.startswith("linux"):
        resident = _linux_resident()
        return resident if resident is not None else _max_rss(unit=1024)  # KiB on Linux
    if platform == "win32":
        rss = _psutil_rss()
        return rss if rss is not None else _windows_working_set()
    if platform == "darwin":
        rss = _psutil_rss()
        return rss if rss is not None else _max_rss(unit=1)  # bytes on macOS
    return _psutil_rss()


def _linux_resident() -> int | None:
    try:
        with open(_STATM) as statm:
            resident_pages = int(statm.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _max_rss(unit: int) -> int | None:
    """The process's peak resident set from ``getrusage``, times ``unit`` bytes."""
    try:
        import resource
    except ImportError:
        return None
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak * unit if peak > 0 else None


def _psutil_rss() -> int | None:
    try:
        import psutil  # type: ignore[import-untyped]  # no stubs; optional
    except ImportError:
        return None
    try:
        return int(psutil.Process().memory_info().rss)
    except (psutil.Error, OSError):
        return None


class _ProcessMemoryCounters(ctypes.Structure):
    """``PROCESS_MEMORY_COUNTERS`` of the Windows API (psapi.h)."""

    _fields_ = [
        ("cb", ctypes.c_uint32),
        ("PageFaultCount", ctypes.c_uint32),
        ("PeakWorkingSetSize", ctypes.c_size_t),
        ("WorkingSetSize", ctypes.c_size_t),
        ("QuotaPeakPagedPoolUsage", ctypes.c_size_t),
        ("QuotaPagedPoolUsage", ctypes.c_size_t),
        ("QuotaPeakNonPagedPoolUsage", ctypes.c_size_t),
        ("QuotaNonPagedPoolUsage", ctypes.c_size_t),
        ("PagefileUsage", ctypes.c_size_t),
        ("PeakPagefileUsage", ctypes.c_size_t),
    ]


def _windows_working_set() -> int | None:
    """The working set now, from kernel32's ``K32GetProcessMemoryInfo`` (Windows 7 and later)."""
    win_dll = getattr(ctypes, "WinDLL", None)  # only Windows builds of Python have it
    if win_dll is None:
        return None
    try:
        kernel32 = win_dll("kernel32")
        kernel32.GetCurrentProcess.restype = ctypes.c_void_p
        counters = _ProcessMemoryCounters()
        counters.cb = ctypes.sizeof(counters)
        ok = kernel32.K32GetProcessMemoryInfo(
            ctypes.c_void_p(kernel32.GetCurrentProcess()), ctypes.byref(counters), counters.cb
        )
    except (OSError, AttributeError):
        return None
    return int(counters.WorkingSetSize) if ok and counters.WorkingSetSize > 0 else None
