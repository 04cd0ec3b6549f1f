"""How stored features reach the device: stacked in page-locked memory for a CUDA device,
so the copy is queued behind the step's work instead of waiting for the stream."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_speedkit.compute._frozen_core import cache_frozen_features
from lightning_speedkit.compute._frozen_rows import stacked


def _rows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, 7, generator=g) for _ in range(3)]


def test_rows_for_the_cpu_are_stacked_as_they_are() -> None:
    rows = _rows()
    out = stacked(rows, torch.device("cpu"))
    assert torch.equal(out, torch.stack(rows))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_rows_for_cuda_are_stacked_in_page_locked_memory() -> None:
    rows = _rows()
    out = stacked(rows, torch.device("cuda"))
    assert out.is_pinned()
    assert torch.equal(out, torch.stack(rows))


@pytest.mark.gpu
@needs_cuda
def test_served_features_on_cuda_equal_the_towers_without_a_sync() -> None:
    torch.manual_seed(0)
    tower = nn.Sequential(nn.Linear(16, 32), nn.Tanh()).cuda().requires_grad_(False)
    model = nn.Sequential(tower, nn.Linear(32, 1)).cuda()
    x = torch.randn(8, 16, device="cuda")
    cache = cache_frozen_features(model, ["0"], verify=False)
    with cache.keys(range(8)):
        first = tower(x)  # runs and stores (a copy to the host: a sync, once)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # serving must not wait for the device
    try:
        with cache.keys(range(8)):
            served = tower(x)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert cache.counts()["hits"] == 8
    assert served.device == first.device
    assert torch.equal(served, first)
