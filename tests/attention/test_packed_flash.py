"""The ``flash`` backend on packed batches: flash-attn's variable-length kernel on ``cu_seqlens``.

flash-attn cannot run here (CUDA only): a stand-in ``flash_attn`` module whose
``flash_attn_varlen_func`` does what flash-attn documents (each ``cu_seqlens`` span of the
flattened ``(tokens, heads, head_dim)`` rows attends to itself only, causal when asked,
grouped key/value heads native) checks what our code hands it and that the result is the
per-document SDPA path's, outputs and gradients. The real kernel is compared on a GPU that
has flash-attn (marked ``flash_attn``).
"""

from __future__ import annotations

import copy
import itertools
import sys
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_speedkit import swap_attention
from lightning_speedkit.attention import backends, packed_documents
from lightning_speedkit.attention._parity import DEFAULT_TOLERANCE
from lightning_speedkit.attention.backends import Attend
from lightning_speedkit.data import PackingCollate

from .test_packed_documents import NanoGPT, _samples

LENGTHS = (5, 3, 7, 2, 4, 6)  # rows of 12: [5, 3, pad 4], [7, 2, pad 3], [4, 6, pad 2]
#: Every span of every row, padding included, cumulated across the rows of 12.
CU_SEQLENS = [0, 5, 8, 12, 19, 21, 24, 28, 34, 36]


def _batch() -> dict[str, Any]:
    return PackingCollate(max_tokens=12)([{"input_ids": torch.zeros(n, dtype=torch.long)}
                                          for n in LENGTHS])  # fmt: skip


def _qkv(kv_heads: int = 4, grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 12, 16, generator=g)
    k, v = (torch.randn(3, kv_heads, 12, 16, generator=g) for _ in range(2))
    return q.requires_grad_(grad), k.requires_grad_(grad), v.requires_grad_(grad)


def _flash_attn_varlen_func(calls: list[dict[str, Any]]) -> Any:
    """flash-attn's documented semantics, one SDPA call per ``cu_seqlens`` span."""

    def flash_attn_varlen_func(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
    ) -> Tensor:
        calls.append(
            {"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape),
             "contiguous": all(t.is_contiguous() for t in (q, k, v)),
             "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
             "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k,
             "dropout_p": dropout_p, "softmax_scale": softmax_scale, "causal": causal}
        )  # fmt: skip
        assert torch.equal(cu_seqlens_q, cu_seqlens_k)  # self-attention: one layout
        pieces = [
            F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                dropout_p=dropout_p, is_causal=causal, scale=softmax_scale, enable_gqa=True,
            ).transpose(0, 1)
            for s, e in itertools.pairwise(cu_seqlens_q.tolist())
        ]  # fmt: skip
        return torch.cat(pieces)

    return flash_attn_varlen_func


def _install(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The stand-in installed, and CPU tensors of the ``flash`` backend routed to it.

    No dense ``flash_attn_func``: a call that took the dense route instead would fail.
    """
    calls: list[dict[str, Any]] = []
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = _flash_attn_varlen_func(calls)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    real_route = backends._route

    def route(backend: str, device_type: str, dtype: torch.dtype, has_mask: bool) -> str:
        if backend == "flash" and not has_mask:  # as on CUDA in half precision, installed
            return "flash_attn"
        return real_route(backend, device_type, dtype, has_mask)

    monkeypatch.setattr(backends, "_route", route)
    return calls


@pytest.fixture
def varlen(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    return _install(monkeypatch)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gets_every_span_flattened_and_equals_per_document_sdpa(
    varlen: list[dict[str, Any]], causal: bool, kv_heads: int
) -> None:
    q, k, v = _qkv(kv_heads)
    with packed_documents(_batch()), torch.no_grad():
        reference = Attend("sdpa")(q, k, v, is_causal=causal, scale=0.3)  # cut per document
        assert varlen == []
        out = Attend("flash")(q, k, v, is_causal=causal, scale=0.3)
    (call,) = varlen
    cu = call.pop("cu_seqlens_q")
    assert call.pop("cu_seqlens_k") is cu  # one tensor for queries and keys
    assert cu.dtype == torch.int32
    assert cu.device == q.device
    assert cu.tolist() == CU_SEQLENS  # padding spans included, offsets across the rows
    assert call == {
        "q": (36, 4, 16), "k": (36, kv_heads, 16), "v": (36, kv_heads, 16), "contiguous": True,
        "max_seqlen_q": 7, "max_seqlen_k": 7, "dropout_p": 0.0, "softmax_scale": 0.3,
        "causal": causal,
    }  # fmt: skip
    assert out.shape == (3, 4, 12, 16)
    assert (out - reference).abs().max().item() <= 1e-5


def test_dropout_goes_to_the_kernel(varlen: list[dict[str, Any]]) -> None:
    """flash-attn drops attention weights itself (as its dense call does): one call still."""
    q, k, v = _qkv()
    with packed_documents(_batch()), torch.no_grad():
        Attend("flash")(q, k, v, is_causal=True, dropout_p=0.1)
    assert [call["dropout_p"] for call in varlen] == [0.1]


def test_a_dense_mask_is_cut_per_document_instead(varlen: list[dict[str, Any]]) -> None:
    """flash-attn takes no dense mask: the call is cut, each piece with its block of it."""
    q, k, v = _qkv()
    mask = torch.rand(3, 1, 12, 12, generator=torch.Generator().manual_seed(1)) > 0.3
    mask |= torch.eye(12, dtype=torch.bool)
    with packed_documents(_batch()), torch.no_grad():
        reference = Attend("sdpa")(q, k, v, attn_mask=mask)
        out = Attend("flash")(q, k, v, attn_mask=mask)
    assert varlen == []
    assert (out - reference).abs().max().item() <= 1e-5


def test_rows_of_another_length_take_the_dense_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call that is not over the packed rows is not the documents' (a cross-attention)."""
    calls: list[tuple[int, ...]] = []

    def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
        calls.append(tuple(q.shape))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=kwargs["softmax_scale"])
        return out.transpose(1, 2)

    module = types.ModuleType("flash_attn")
    module.flash_attn_func = flash_attn_func  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr(backends, "_route", lambda *args: "flash_attn")
    q, k, v = (torch.randn(3, 4, 5, 16) for _ in range(3))
    with packed_documents(_batch()), torch.no_grad():
        out = Attend("flash")(q, k, v)
    assert calls == [(3, 5, 4, 16)]  # the whole call, flash-attn's (B, N, H, D) layout
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def _losses(model: torch.nn.Module, batch: dict[str, Any]) -> Tensor:
    logits = model(batch["input_ids"], batch["position_ids"])
    losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    return losses[batch["labels"].flatten() != -100]


def _grads(model: torch.nn.Module, loss: Tensor) -> dict[str, Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_swapped_model_trains_packed_through_varlen_as_per_document_sdpa(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    flash_model = NanoGPT(layers=3)
    sdpa_model = copy.deepcopy(flash_model)
    swap_attention(flash_model, "flash")
    swap_attention(sdpa_model, "sdpa")
    batch, other = (PackingCollate(max_tokens=12)(_samples(seed)) for seed in (0, 1))
    for model in (flash_model, sdpa_model):  # each module is checked at its first call
        _grads(model, _losses(model, batch).sum())  # (whole rows, dense): before the stand-in
    calls = _install(monkeypatch)
    with packed_documents(batch) as documents:
        reference = _losses(sdpa_model, batch)  # per-document SDPA
        reference_grads = _grads(sdpa_model, reference.sum())
        assert calls == []
        packed = _losses(flash_model, batch)
        packed_grads = _grads(flash_model, packed.sum())
    assert [c["q"] for c in calls] == [(36, 4, 8)] * 3  # one call per layer, whole rows
    assert all(c["causal"] and c["softmax_scale"] is None for c in calls)
    # the batch's cu_seqlens, built once and kept on its documents, for every layer
    assert all(c["cu_seqlens_q"] is calls[0]["cu_seqlens_q"] for c in calls)
    assert list(documents.cache) == [("flash_cu_seqlens", "cpu")]
    assert calls[0]["cu_seqlens_q"].tolist() == CU_SEQLENS
    assert packed.shape == reference.shape == (sum(LENGTHS),)
    assert (packed - reference).abs().max().item() <= 1e-5
    assert packed_grads.keys() == reference_grads.keys()
    assert len(packed_grads) > 0
    errors = [(packed_grads[n] - g).abs().max().item() for n, g in reference_grads.items()]
    assert max(errors) <= 1e-5
    with packed_documents(other), torch.no_grad():  # the next batch builds its own
        _losses(flash_model, other)
    assert calls[3]["cu_seqlens_q"] is not calls[0]["cu_seqlens_q"]
    assert all(c["cu_seqlens_q"] is calls[3]["cu_seqlens_q"] for c in calls[3:])
    assert len(calls) == 6


@pytest.mark.flash_attn
def test_flash_attn_varlen_equals_per_document_sdpa_on_cuda_in_bf16() -> None:
    import flash_attn

    real = flash_attn.flash_attn_varlen_func
    used: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Tensor:
        used.append(1)
        return real(*args, **kwargs)

    q, k, v = (t.detach().cuda() for t in _qkv(kv_heads=2))
    half = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    full = [t.float().requires_grad_() for t in (q, k, v)]
    batch = {key: t.cuda() if isinstance(t, Tensor) else t for key, t in _batch().items()}
    with pytest.MonkeyPatch.context() as patch, packed_documents(batch):
        patch.setattr(flash_attn, "flash_attn_varlen_func", counting)
        out = Attend("flash")(*half, is_causal=True)
        reference = Attend("sdpa")(*full, is_causal=True)  # per document, float32
    assert used == [1]
    projection = torch.randn_like(reference)
    (out.float() * projection).sum().backward()
    (reference * projection).sum().backward()
    tolerance = DEFAULT_TOLERANCE[torch.bfloat16]  # what AttentionSwap's check allows

    def error(a: Tensor, b: Tensor) -> float:
        return ((a.float() - b).abs().max() / b.abs().max()).item()

    assert error(out, reference) <= tolerance
    for h, f in zip(half, full, strict=True):
        assert h.grad is not None
        assert f.grad is not None
        assert error(h.grad, f.grad) <= tolerance
