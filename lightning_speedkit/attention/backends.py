"""Attention backends: one ``attend`` call, many kernels.

Every backend takes query, key and value in SDPA's layout ``(batch, heads, seq,
head_dim)`` and returns the same layout, so an adapter writes its attention once
and the backend is a setting:

==============  ==========================================================
backend         what runs
==============  ==========================================================
``sdpa``        ``F.scaled_dot_product_attention``; PyTorch picks the kernel
``flash``       flash-attn's ``flash_attn_func`` when installed (CUDA, fp16/bf16;
                ``flash_attn_varlen_func`` on a packed batch), else SDPA
                restricted to its flash kernel (CPU has one)
``efficient``   xformers' ``memory_efficient_attention`` when installed (CUDA),
                else SDPA restricted to its memory-efficient kernel
``cudnn``       SDPA restricted to cuDNN attention (CUDA only)
``flex``        FlexAttention, compiled (CUDA; no backward on CPU)
``math``        SDPA's reference math kernel (what eager code computes)
==============  ==========================================================

A backend the device cannot run (``efficient`` or ``cudnn`` on CPU, ``flash`` on
fp32 CUDA tensors, ...) is reported once with the reason and the call runs
``sdpa`` instead; the fallback is remembered, so later calls pay nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_speedkit import _imports
from lightning_speedkit.attention import _documents
from lightning_speedkit.attention._flash_documents import flash_per_document
from lightning_speedkit.attention._flex_documents import flex_per_document, run_flex
from lightning_speedkit.errors import SpeedkitConfigError

log = logging.getLogger(__name__)

Backend = Literal["sdpa", "flash", "efficient", "cudnn", "flex", "math"]
BackendChoice = Literal["auto", "sdpa", "flash", "efficient", "cudnn", "flex", "math"]
BACKENDS: tuple[str, ...] = get_args(Backend)

_SDPA_KERNEL: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
#: How PyTorch says a restricted SDPA has no kernel for the inputs (wording varies by version).
_NO_KERNEL = ("No viable backend", "No available kernel")

#: (backend, device type, dtype, reason) already reported, so each is said once.
_WARNED: set[tuple[str, str, str]] = set()
#: Above 0 while a fallback is provisional: neither said nor remembered (see below).
_PROVISIONAL = [0]


@contextlib.contextmanager
def provisional_fallbacks() -> Iterator[None]:
    """A backend that cannot run inside falls back to ``sdpa`` without a word and without
    remembering it: for the swap's check on its own small input, which runs where the
    module is at swap time (a Lightning fit swaps before it moves the model to the GPU),
    not where it will train. The first real call says it, where it applies."""
    _PROVISIONAL[0] += 1
    try:
        yield
    finally:
        _PROVISIONAL[0] -= 1


def check_backend(backend: str, *, allow_auto: bool = True) -> None:
    """Raise :class:`SpeedkitConfigError` for a backend name we do not know."""
    known = ("auto", *BACKENDS) if allow_auto else BACKENDS
    if backend not in known:
        raise SpeedkitConfigError(
            f"`backend={backend!r}` is not an attention backend. Choose one of "
            f"{', '.join(repr(name) for name in known)}."
        )


def auto_candidates(device: torch.device) -> tuple[Backend, ...]:
    """The backends ``"auto"`` times on a device, cheapest to try first.

    ``flex`` is left out: its first call compiles for tens of seconds, which a
    per-module timing cannot amortise. Ask for it by name.
    """
    if device.type == "cuda":
        return ("sdpa", "flash", "efficient", "cudnn")
    return ("sdpa", "flash", "math")


def _warn_fallback(backend: str, device_type: str, reason: str) -> None:
    key = (backend, device_type, reason)
    if key not in _WARNED:
        _WARNED.add(key)
        rank_zero_warn(
            f"Attention backend {backend!r} cannot run here ({device_type}: {reason}); "
            "running 'sdpa' instead."
        )


class Attend:
    """Scaled dot-product attention through one named backend.

    Args:
        backend: one of :data:`BACKENDS`.

    Call it like ``F.scaled_dot_product_attention`` (``(B, H, N, D)`` tensors;
    ``enable_gqa`` is implied when key and value have fewer heads than query).

    Example::

        >>> attend = Attend("math")
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> out = attend(q, k, v, is_causal=True)
        >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
        True
    """

    def __init__(self, backend: str) -> None:
        check_backend(backend, allow_auto=False)
        self.backend = backend
        # (device type, dtype, needs grad) -> reason this backend cannot run there.
        self._unavailable: dict[tuple[str, torch.dtype, bool], str] = {}

    def __repr__(self) -> str:
        return f"Attend({self.backend!r})"

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
        dropout_p: float = 0.0,
    ) -> Tensor:
        documents = _documents.active()
        if documents is not None and documents.covers(q, k, is_causal):  # packed: per document
            if self._flex_runs(q, attn_mask, dropout_p):  # one call, a document block mask
                return flex_per_document(
                    _flex_function(q.device), documents, q, k, v, is_causal=is_causal, scale=scale
                )
            if self._varlen_runs(q, attn_mask):  # one flash-attn call on cu_seqlens
                return flash_per_document(
                    documents, q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p
                )
            return _documents.per_document(
                self._attend, documents, q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                scale=scale, dropout_p=dropout_p,
            )  # fmt: skip
        return self._attend(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p
        )

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        attn_mask: Tensor | None,
        is_causal: bool,
        scale: float | None,
        dropout_p: float,
    ) -> Tensor:
        key = (q.device.type, q.dtype, q.requires_grad and torch.is_grad_enabled())
        if key not in self._unavailable:
            reason = self._cannot_run(q, attn_mask, key[2])
            if reason is None:
                try:
                    return self._run(q, k, v, attn_mask, is_causal, scale, dropout_p)
                except RuntimeError as error:
                    if not any(m in str(error) for m in _NO_KERNEL):
                        raise
                    reason = "PyTorch has no such kernel for these inputs"
            if not _PROVISIONAL[0]:
                if attn_mask is None:  # a mask-specific refusal is not remembered
                    self._unavailable[key] = reason
                _warn_fallback(self.backend, q.device.type, reason)
        return _sdpa(q, k, v, attn_mask, is_causal, scale, dropout_p)

    def describe(self, device: torch.device) -> str:
        """What runs for this backend on ``device``, fallbacks included."""
        for (device_type, _, _), reason in self._unavailable.items():
            if device_type == device.type:
                return f"sdpa ({self.backend} unavailable: {reason})"
        if device.type == "cuda":
            if self.backend == "flash" and _imports.FLASH_ATTN_AVAILABLE:
                return "flash (flash-attn)"
            if self.backend == "efficient" and _imports.XFORMERS_AVAILABLE:
                return "efficient (xformers)"
        return self.backend

    @contextlib.contextmanager
    def sdpa_kernel(self, device: torch.device | None = None) -> Iterator[None]:
        """Restrict ``F.scaled_dot_product_attention`` calls inside to this backend.

        For code that calls SDPA itself (timm, Hugging Face, ``nn.MultiheadAttention``).
        While a packed batch's documents are active, its SDPA calls on the packed rows run
        per document (:mod:`._documents`).
        A kernel the device lacks is not forced (PyTorch would refuse the call):
        that is reported once, and SDPA picks. ``flex`` cannot be reached this
        way: SDPA picks, said once.
        """
        kernel = _SDPA_KERNEL.get(self.backend)
        device_type = device.type if device is not None else "cpu"
        reason = None
        if self.backend == "flex":
            reason = "this family calls SDPA itself; FlexAttention needs its own adapter"
        elif self.backend in ("efficient", "cudnn") and device_type != "cuda":
            reason = f"{self.backend} attention has CUDA kernels only"
        if reason is not None:
            key = (device_type, torch.float32, False)
            if key not in self._unavailable:
                self._unavailable[key] = reason
                _warn_fallback(self.backend, device_type, reason)
            kernel = None
        with contextlib.ExitStack() as stack:
            if kernel is not None:
                stack.enter_context(sdpa_kernel([kernel]))
            stack.enter_context(_documents.sdpa_per_document())  # a packed batch: per document
            yield

    def _flex_runs(self, q: Tensor, attn_mask: Tensor | None, dropout_p: float) -> bool:
        """Whether this call runs FlexAttention itself (else it is cut per document, and
        each piece takes :meth:`_attend`'s way, fallbacks said there)."""
        if self.backend != "flex" or attn_mask is not None or dropout_p != 0.0:
            return False
        key = (q.device.type, q.dtype, q.requires_grad and torch.is_grad_enabled())
        return key not in self._unavailable and self._cannot_run(q, None, key[2]) is None

    def _varlen_runs(self, q: Tensor, attn_mask: Tensor | None) -> bool:
        """Whether this call runs flash-attn's variable-length kernel on the packed rows
        (where a call over whole rows would run flash-attn's, :func:`_route`)."""
        key = (q.device.type, q.dtype, q.requires_grad and torch.is_grad_enabled())
        route = _route(self.backend, q.device.type, q.dtype, attn_mask is not None)
        return route == "flash_attn" and key not in self._unavailable

    def _cannot_run(self, q: Tensor, attn_mask: Tensor | None, needs_grad: bool) -> str | None:
        cuda = q.device.type == "cuda"
        if self.backend in ("efficient", "cudnn") and not cuda:
            return f"{self.backend} attention has CUDA kernels only"
        if self.backend == "flex":
            if not cuda and needs_grad:
                return "FlexAttention has no backward on CPU"
            if cuda and q.shape[-1] < _FLEX_SMALLEST_HEAD:  # compiled: Inductor refuses
                return (
                    f"compiled FlexAttention needs a head dimension of at least "
                    f"{_FLEX_SMALLEST_HEAD}, this one has {q.shape[-1]}"
                )
            if attn_mask is not None:
                return "FlexAttention takes a block mask, not a dense attn_mask"
        return None

    def _run(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None,
        is_causal: bool,
        scale: float | None,
        dropout_p: float,
    ) -> Tensor:
        route = _route(self.backend, q.device.type, q.dtype, attn_mask is not None)
        if route == "flash_attn":
            return _flash_attn(q, k, v, is_causal, scale, dropout_p)
        if route == "xformers":
            return _xformers(q, k, v, attn_mask, is_causal, scale, dropout_p)
        if route == "flex":
            return _flex(q, k, v, is_causal, scale)
        if route == "sdpa":
            return _sdpa(q, k, v, attn_mask, is_causal, scale, dropout_p)
        if self.backend in ("efficient", "cudnn"):
            # PyTorch's memory-efficient and cuDNN kernels take no `enable_gqa` (torch 2.11:
            # "No available kernel"); they get the key/value heads repeated.
            k, v = _repeat_kv_heads(q, k, v)
        with sdpa_kernel([_SDPA_KERNEL[self.backend]]):
            return _sdpa(q, k, v, attn_mask, is_causal, scale, dropout_p)


def _route(backend: str, device_type: str, dtype: torch.dtype, has_mask: bool) -> str:
    """Which implementation a backend runs for these inputs.

    ``flash_attn`` / ``xformers`` (the libraries, CUDA only), ``flex``, ``sdpa``
    (PyTorch picks), or ``kernel`` (SDPA restricted to the backend's kernel).
    """
    cuda = device_type == "cuda"
    half = dtype in (torch.float16, torch.bfloat16)  # flash-attn has no fp32 kernel
    if backend == "flash" and cuda and half and _imports.FLASH_ATTN_AVAILABLE and not has_mask:
        return "flash_attn"
    if backend == "efficient" and cuda and _imports.XFORMERS_AVAILABLE:
        return "xformers"
    if backend in ("flex", "sdpa"):
        return backend
    return "kernel"


def _sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    dropout_p: float,
) -> Tensor:
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def _flash_attn(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None, dropout_p: float
) -> Tensor:
    """flash-attn's kernel: ``(B, N, H, D)`` layout; grouped key/value heads natively."""
    from flash_attn import flash_attn_func

    out = flash_attn_func(
        *_swap_seq_and_heads(q, k, v), dropout_p=dropout_p, softmax_scale=scale, causal=is_causal
    )
    return out.transpose(1, 2)


def _swap_seq_and_heads(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``(B, H, N, D)`` <-> ``(B, N, H, D)``, the libraries' layout (views, no copies)."""
    return tuple(t.transpose(1, 2) for t in tensors)


def _repeat_kv_heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Grouped-query attention for kernels without it: each key/value head repeated."""
    if k.shape[1] == q.shape[1]:
        return k, v
    groups = q.shape[1] // k.shape[1]
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _xformers(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    dropout_p: float,
) -> Tensor:
    """xformers' memory-efficient kernel: ``(B, N, H, D)`` layout, equal head counts."""
    from xformers.ops import LowerTriangularMask, memory_efficient_attention

    k, v = _repeat_kv_heads(q, k, v)
    bias: Any = LowerTriangularMask() if is_causal else None
    if attn_mask is not None:
        if is_causal:
            raise RuntimeError("No viable backend: xformers takes a mask or causal, not both")
        bias = _additive(attn_mask, q.dtype)
    out = memory_efficient_attention(
        *_swap_seq_and_heads(q, k, v), attn_bias=bias, p=dropout_p, scale=scale
    )
    return out.transpose(1, 2)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, float("-inf")
        )
    return mask.to(dtype)


_COMPILED_FLEX: Callable[..., Tensor] | None = None
#: The smallest head dimension compiled FlexAttention takes (torch 2.11's Inductor: "NYI:
#: embedding dimension of the query, key, and value must be at least 16").
_FLEX_SMALLEST_HEAD = 16


def _flex_function(device: torch.device) -> Callable[..., Tensor]:
    """FlexAttention compiled on CUDA; elsewhere its eager reference (inference only)."""
    from torch.nn.attention.flex_attention import flex_attention

    global _COMPILED_FLEX
    if device.type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention)
    return _COMPILED_FLEX


def _flex(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None) -> Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    fn = _flex_function(q.device)
    block_mask = None
    if is_causal:
        block_mask = create_block_mask(
            _causal_mask_mod, None, None, q.shape[-2], k.shape[-2], device=q.device
        )
    return run_flex(
        fn, q, k, v, block_mask, scale, lambda: [(q.shape[0], q.shape[-2], k.shape[-2])]
    )


def _causal_mask_mod(batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= kv_idx
