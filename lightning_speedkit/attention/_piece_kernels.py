"""The SDPA kernels a packed batch's per-document pieces may run on: not cuDNN's.

cuDNN's attention builds an execution plan for each new shape (hundreds of milliseconds,
then cached by shape). Whole rows repeat their shape from step to step; the pieces of
per-document attention do not: documents of a long-tailed corpus are each of a new
length. On an H200 (2026-11-29, torch 2.11, bf16) training a nanoGPT-style decoder
packed, per document on SDPA as PyTorch picks it, ran 5,268 tokens/s where the same
model padded ran 207,928: most likely a plan built per document (not profiled). The
pieces therefore run on the kernels PyTorch allows now, less cuDNN's (flash and
memory-efficient attention have no per-shape plan). Where cuDNN is the only kernel
allowed, it is left as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["without_cudnn"]


@contextlib.contextmanager
def without_cudnn(device: torch.device) -> Iterator[None]:
    """SDPA calls inside run on the kernels allowed now, cuDNN's left out, on CUDA."""
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        yield
        return
    allowed = [
        backend
        for backend, enabled in (
            (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
            (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled()),
            (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled()),
        )
        if enabled
    ]
    if not allowed:  # cuDNN alone: the user's choice
        yield
        return
    with sdpa_kernel(allowed):
        yield
