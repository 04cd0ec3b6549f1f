"""The memory a trial may use, computed from injected /proc readings; optimizer reserves."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_speedkit.compute import _memory_probe
from lightning_speedkit.compute._memory_probe import (
    PeakMemory,
    memory_limit,
    optimizer_state_bytes,
    out_of_memory,
)


def test_the_cpu_limit_is_what_is_held_plus_the_free_share_less_the_reserve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kib = {("/proc/self/status", "VmRSS"): 1000, ("/proc/meminfo", "MemAvailable"): 4000}
    monkeypatch.setattr(_memory_probe, "_proc_kib", lambda path, key: kib[(path, key)])
    assert memory_limit("cpu", memory_headroom=0.25) == 1024 * (1000 + 3000)
    assert memory_limit("cpu", 0.25, reserve_bytes=24) == 1024 * 4000 - 24
    monkeypatch.setattr(_memory_probe, "_proc_kib", lambda path, key: None)  # no /proc
    assert memory_limit("cpu") is None
    assert memory_limit("meta") is None
    assert PeakMemory(torch.device("meta")).read() is None


def test_a_proc_line_is_read_in_kib(tmp_path: object) -> None:
    path = tmp_path / "status"  # type: ignore[operator]
    path.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t 1024 kB\n")
    assert _memory_probe._proc_kib(str(path), "VmRSS") == 1024
    assert _memory_probe._proc_kib(str(path), "VmSwap") is None
    assert _memory_probe._proc_kib(str(path) + ".missing", "VmRSS") is None


def test_optimizer_state_not_yet_created_is_reserved_per_kind() -> None:
    weight = nn.Parameter(torch.ones(10))  # 40 bytes
    assert optimizer_state_bytes([torch.optim.AdamW([weight])]) == 80
    assert optimizer_state_bytes([torch.optim.SGD([weight], lr=0.1, momentum=0.9)]) == 40
    assert optimizer_state_bytes([torch.optim.SGD([weight], lr=0.1)]) == 0
    assert optimizer_state_bytes([torch.optim.RMSprop([weight])]) == 40

    class Wrapper:  # Lightning's LightningOptimizer, DeepSpeed's: `.optimizer` inside
        def __init__(self, optimizer: object) -> None:
            self.optimizer = optimizer

    stepped = torch.optim.Adam([weight])
    weight.grad = torch.ones(10)
    stepped.step()  # its state exists now: nothing more to reserve
    assert optimizer_state_bytes([Wrapper(torch.optim.Adam([weight])), stepped, "no"]) == 80


@pytest.mark.parametrize(
    ("error", "oom"),
    [
        (torch.OutOfMemoryError("CUDA out of memory"), True),
        (MemoryError(), True),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 9 GB"), True),
        (RuntimeError("CUDA error: out of memory"), True),
        (RuntimeError("Expected more than 1 value per channel"), False),
        (ValueError("out of memory"), False),
    ],
)
def test_out_of_memory_is_told_from_other_errors(error: BaseException, oom: bool) -> None:
    assert out_of_memory(error) is oom
