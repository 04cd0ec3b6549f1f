"""A packed batch's per-document pieces run on SDPA without cuDNN's kernel on CUDA: cuDNN
builds a plan per new shape, and the pieces' shapes are the documents' lengths (on an
H200 the packed arm ran 40x slower than padding, 2026-11-29)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_speedkit.attention import _documents, packed_documents
from lightning_speedkit.attention._piece_kernels import without_cudnn
from lightning_speedkit.data import PackingCollate


def _enabled() -> dict[str, bool]:
    return {
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
    }


def test_on_cuda_cudnn_is_left_out_and_the_rest_kept() -> None:
    before = _enabled()
    allowed = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(allowed), without_cudnn(torch.device("cuda")):
        inside = _enabled()
    assert inside == {"cudnn": False, "flash": False, "efficient": True, "math": False}
    assert _enabled() == before


def test_cudnn_alone_or_another_device_is_left_as_it_is() -> None:
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), without_cudnn(torch.device("cuda")):
        assert _enabled()["cudnn"]
    with without_cudnn(torch.device("cpu")):
        assert _enabled()["cudnn"] == torch.backends.cuda.cudnn_sdp_enabled()


def test_each_piece_runs_with_cudnn_left_out_on_cuda(monkeypatch: Any) -> None:
    # The tensors are on the CPU: the context is given CUDA's device, so that what the
    # pieces run under is what a CUDA device gets.
    real = _documents.without_cudnn
    monkeypatch.setattr(_documents, "without_cudnn", lambda d: real(torch.device("cuda")))
    batch = PackingCollate(max_tokens=8)(
        [{"input_ids": torch.zeros(n, dtype=torch.long)} for n in (5, 3, 6)]
    )
    q = torch.randn(2, 2, 8, 4)
    cudnn_in_pieces: list[bool] = []

    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        cudnn_in_pieces.append(torch.backends.cuda.cudnn_sdp_enabled())
        return x

    with packed_documents(batch) as documents:
        out = _documents.per_document(run, documents, q, q, q, is_causal=True)
        rows = torch.randn(2, 8, 4)
        mha, _ = _documents.per_document_rows(
            lambda x, *masks: (run(x), None), documents, rows, lambda group: (None, None),
            batch_first=True,
        )  # fmt: skip
    assert cudnn_in_pieces == [False] * 8  # spans of 5, 3, 6 and 2 (padding), in each call
    assert torch.backends.cuda.cudnn_sdp_enabled()  # as it was after
    assert torch.equal(out, q)
    assert torch.equal(mha, rows)
