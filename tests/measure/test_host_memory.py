"""Host memory on each platform: the right source and the right unit, or None, never a guess.

Each platform is simulated: ``sys.platform`` is set, and the modules that platform has
(or lacks) are put in ``sys.modules``: a stand-in ``resource`` reporting a known
``ru_maxrss``, a stand-in ``psutil``, or None where the module is missing (Windows has
no ``resource``). Windows' ``GetProcessMemoryInfo`` is a stand-in ``ctypes.WinDLL``
that fills the real counters structure the module passes it.
"""

from __future__ import annotations

import ctypes
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_speedkit.measure import _host_memory, speed_monitor
from lightning_speedkit.measure._host_memory import host_memory_bytes

GIB = 2**30


def _fake_resource(max_rss: int) -> types.ModuleType:
    module = types.ModuleType("resource")
    module.RUSAGE_SELF = 0  # type: ignore[attr-defined]
    module.getrusage = lambda who: types.SimpleNamespace(ru_maxrss=max_rss)  # type: ignore[attr-defined]
    return module


def _fake_psutil(rss: int) -> types.ModuleType:
    module = types.ModuleType("psutil")
    memory = types.SimpleNamespace(rss=rss, vms=10 * rss)
    module.Process = lambda: types.SimpleNamespace(memory_info=lambda: memory)  # type: ignore[attr-defined]
    module.Error = RuntimeError  # type: ignore[attr-defined]
    return module


class _Kernel32:
    """kernel32 as ctypes would load it, with GetProcessMemoryInfo answering a known figure."""

    def __init__(self, working_set: int, ok: int = 1) -> None:
        self.working_set = working_set
        self.ok = ok
        self.sizes: list[tuple[int, int]] = []

        def current_process() -> int:
            return -1  # Windows' pseudo-handle for this process

        self.GetCurrentProcess = current_process

    def K32GetProcessMemoryInfo(self, handle: Any, counters_ref: Any, size: int) -> int:  # noqa: N802 (the API's name)
        counters = counters_ref._obj  # what ctypes.byref points at
        self.sizes.append((size, counters.cb))
        counters.WorkingSetSize = self.working_set
        counters.PeakWorkingSetSize = 3 * self.working_set
        return self.ok


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set the simulated platform and which of its modules exist."""

    def simulate(name: str, resource: Any = None, psutil: Any = None) -> None:
        monkeypatch.setattr(sys, "platform", name)
        monkeypatch.setitem(sys.modules, "resource", resource)  # None: import fails
        monkeypatch.setitem(sys.modules, "psutil", psutil)
        monkeypatch.delattr(ctypes, "WinDLL", raising=False)  # only Windows Pythons have it

    return simulate


def test_linux_reads_the_resident_set_in_pages(
    platform: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    statm = tmp_path / "statm"
    statm.write_text("90000 2500 300 10 0 800 0\n")  # size resident shared text lib data dt
    monkeypatch.setattr(_host_memory, "_STATM", str(statm))
    platform("linux", resource=_fake_resource(max_rss=999_999))  # the peak is not what is read
    assert host_memory_bytes() == 2500 * os.sysconf("SC_PAGE_SIZE")


def test_linux_without_proc_falls_back_to_the_peak_in_kib(
    platform: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(_host_memory, "_STATM", str(tmp_path / "no-proc" / "statm"))
    platform("linux", resource=_fake_resource(max_rss=2048))
    assert host_memory_bytes() == 2048 * 1024


def test_linux_with_nothing_readable_is_unknown(
    platform: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "statm").write_text("garbled")
    monkeypatch.setattr(_host_memory, "_STATM", str(tmp_path / "statm"))
    platform("linux", resource=None)
    assert host_memory_bytes() is None


def test_macos_ru_maxrss_is_already_bytes(platform: Any) -> None:
    platform("darwin", resource=_fake_resource(max_rss=123_456_789), psutil=None)
    assert host_memory_bytes() == 123_456_789  # not x1024: macOS reports bytes


def test_macos_prefers_psutil_for_the_resident_set_now(platform: Any) -> None:
    platform("darwin", resource=_fake_resource(max_rss=9_999_999), psutil=_fake_psutil(5_000_000))
    assert host_memory_bytes() == 5_000_000


def test_windows_without_resource_reads_the_working_set_through_ctypes(
    platform: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    platform("win32", resource=None, psutil=None)
    kernel32 = _Kernel32(working_set=7_340_032)
    monkeypatch.setattr(ctypes, "WinDLL", lambda name: kernel32, raising=False)
    assert host_memory_bytes() == 7_340_032  # the working set now, not the peak
    size = ctypes.sizeof(_host_memory._ProcessMemoryCounters)
    assert kernel32.sizes == [(size, size)]  # cb set as the API requires
    assert size == 2 * 4 + 8 * ctypes.sizeof(ctypes.c_size_t)  # PROCESS_MEMORY_COUNTERS' layout


def test_windows_failed_call_is_unknown(platform: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    platform("win32", resource=None, psutil=None)
    monkeypatch.setattr(ctypes, "WinDLL", lambda name: _Kernel32(7_340_032, ok=0), raising=False)
    assert host_memory_bytes() is None


def test_windows_prefers_psutil(platform: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    platform("win32", resource=None, psutil=_fake_psutil(6_000_000))
    monkeypatch.setattr(ctypes, "WinDLL", lambda name: _Kernel32(1), raising=False)
    assert host_memory_bytes() == 6_000_000


def test_other_platforms_never_guess_a_unit(platform: Any) -> None:
    platform("sunos5", resource=_fake_resource(max_rss=4096), psutil=None)
    assert host_memory_bytes() is None
    platform("sunos5", resource=_fake_resource(max_rss=4096), psutil=_fake_psutil(4_000_000))
    assert host_memory_bytes() == 4_000_000


def test_this_machine_gives_a_figure() -> None:
    held = host_memory_bytes()
    assert held is not None
    assert 10 * 2**20 < held < 1024 * GIB  # this test process: torch is loaded, far from a TiB


@pytest.mark.parametrize(("held", "gib"), [(3 * GIB, 3.0), (GIB // 2, 0.5), (None, 0.0)])
def test_speed_monitor_reads_host_memory_on_cpu(
    monkeypatch: pytest.MonkeyPatch, held: int | None, gib: float
) -> None:
    monkeypatch.setattr(speed_monitor, "host_memory_bytes", lambda: held)
    # 0.0 is SpeedMonitor's "unknown": mem_peak_gib is then left out of the figures
    assert speed_monitor._memory_peak_gib(torch.device("cpu")) == gib
