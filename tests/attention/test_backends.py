"""Attention backends: equal numbers on CPU, honest fallbacks, library dispatch and layout."""

from __future__ import annotations

import sys
import types
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_speedkit import SpeedkitConfigError, _imports
from lightning_speedkit.attention import backends
from lightning_speedkit.attention.backends import Attend, _flash_attn, _route, _xformers


def _qkv(kv_heads: int = 4, grad: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, 16, generator=generator)
    k = torch.randn(2, kv_heads, 24, 16, generator=generator)
    v = torch.randn(2, kv_heads, 24, 16, generator=generator)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))  # type: ignore[return-value]


def _eager(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("backend", ["sdpa", "flash", "math"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_cpu_backends_match_eager_attention(backend: str, causal: bool, kv_heads: int) -> None:
    q, k, v = _qkv(kv_heads)
    out = Attend(backend)(q, k, v, is_causal=causal)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref = _eager(q, k, v, causal)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_cuda_only_backend_on_cpu_falls_back_to_sdpa_and_says_so_once(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backends, "_WARNED", set())
    attend = Attend(backend)
    q, k, v = _qkv()
    with pytest.warns(
        UserWarning, match=f"'{backend}' cannot run here .*CUDA kernels only.*'sdpa'"
    ):
        out = attend(q, k, v, is_causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        attend(q, k, v, is_causal=True)
    torch.testing.assert_close(out, _eager(q, k, v, True), rtol=1e-5, atol=1e-5)
    assert attend.describe(q.device).startswith("sdpa (")


def test_flex_runs_inference_on_cpu_and_falls_back_for_training(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(backends, "_WARNED", set())
    attend = Attend("flex")
    q, k, v = _qkv(grad=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        out = attend(q, k, v, is_causal=True)
    torch.testing.assert_close(out, _eager(q, k, v, True), rtol=1e-5, atol=1e-5)
    q, k, v = _qkv(grad=True)
    with pytest.warns(UserWarning, match="no backward on CPU"):
        attend(q, k, v, is_causal=True).sum().backward()
    assert q.grad is not None


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(SpeedkitConfigError, match="`backend='fast'` is not an attention backend"):
        Attend("fast")


# -------------------------------------------------- flash-attn and xformers dispatch
# Neither library runs here (flash-attn cannot be installed; xformers has no CPU
# kernel): stand-ins check what our code hands them, in their (B, N, H, D) layout.
# Their numerics are tested on a GPU that has them (tests marked flash_attn/xformers).


def test_route_prefers_the_libraries_on_cuda_half_precision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_imports, "FLASH_ATTN_AVAILABLE", True)
    monkeypatch.setattr(_imports, "XFORMERS_AVAILABLE", True)
    assert _route("flash", "cuda", torch.bfloat16, False) == "flash_attn"
    assert _route("flash", "cuda", torch.float32, False) == "kernel"  # no fp32 flash-attn kernel
    assert _route("flash", "cuda", torch.float16, True) == "kernel"  # no dense masks either
    assert _route("flash", "cpu", torch.bfloat16, False) == "kernel"
    assert _route("efficient", "cuda", torch.float32, True) == "xformers"
    assert _route("efficient", "cpu", torch.float32, False) == "kernel"
    monkeypatch.setattr(_imports, "FLASH_ATTN_AVAILABLE", False)
    assert _route("flash", "cuda", torch.bfloat16, False) == "kernel"  # SDPA's flash kernel


def _stand_in(monkeypatch: pytest.MonkeyPatch, name: str, attrs: dict[str, Any]) -> list[Any]:
    calls: list[Any] = []
    module = types.ModuleType(name)
    for attr, value in attrs.items():
        setattr(module, attr, value if isinstance(value, type) else value(calls))
    monkeypatch.setitem(sys.modules, name, module)
    return calls


def test_flash_attn_gets_bnhd_layout_scale_and_causal(monkeypatch: pytest.MonkeyPatch) -> None:
    def make(calls: list[Any]) -> Any:
        def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
            calls.append((q.shape, k.shape, kwargs))
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=kwargs["causal"],
                scale=kwargs["softmax_scale"],
                enable_gqa=True,
            )
            return out.transpose(1, 2)

        return flash_attn_func

    calls = _stand_in(monkeypatch, "flash_attn", {"flash_attn_func": make})
    q, k, v = _qkv(kv_heads=2)
    out = _flash_attn(q, k, v, True, 0.3, 0.0)
    ((q_shape, k_shape, kwargs),) = calls
    assert q_shape == (2, 24, 4, 16)
    assert k_shape == (2, 24, 2, 16)
    assert kwargs == {"dropout_p": 0.0, "softmax_scale": 0.3, "causal": True}
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, ref)


def test_xformers_gets_bnhd_layout_repeated_kv_heads_and_a_causal_bias(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class LowerTriangularMask:
        pass

    def make(calls: list[Any]) -> Any:
        def memory_efficient_attention(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
            calls.append((q.shape, k.shape, kwargs))
            causal = isinstance(kwargs["attn_bias"], LowerTriangularMask)
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=causal,
                scale=kwargs["scale"],
            )
            return out.transpose(1, 2)

        return memory_efficient_attention

    calls = _stand_in(
        monkeypatch,
        "xformers.ops",
        {"memory_efficient_attention": make, "LowerTriangularMask": LowerTriangularMask},
    )
    monkeypatch.setitem(sys.modules, "xformers", types.ModuleType("xformers"))
    q, k, v = _qkv(kv_heads=2)
    out = _xformers(q, k, v, None, True, None, 0.0)
    ((q_shape, k_shape, kwargs),) = calls
    assert q_shape == (2, 24, 4, 16)
    assert k_shape == (2, 24, 4, 16)
    assert isinstance(kwargs["attn_bias"], LowerTriangularMask)
    assert kwargs["p"] == 0.0
    torch.testing.assert_close(out, _eager(q, k, v, True), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "flash", "efficient", "cudnn", "math"])
def test_cuda_backends_match_math_in_bf16(backend: str) -> None:
    q, k, v = (t.detach().cuda().bfloat16().requires_grad_() for t in _qkv(kv_heads=2))
    out = Attend(backend)(q, k, v, is_causal=True)
    ref = Attend("math")(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.flash_attn
def test_flash_attn_numerics_on_gpu() -> None:
    q, k, v = (t.detach().cuda().half() for t in _qkv(kv_heads=2))
    out = _flash_attn(q, k, v, True, None, 0.0)
    ref = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.xformers
@pytest.mark.gpu
def test_xformers_numerics_on_gpu() -> None:
    q, k, v = (t.detach().cuda().half() for t in _qkv(kv_heads=2))
    out = _xformers(q, k, v, None, True, None, 0.0)
    ref = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True
    )
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
