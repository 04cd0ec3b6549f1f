"""The ``structural`` attention family: custom self-attention found by its structure.

Query/key/value projections (fused or separate, grouped key/value heads), an output
projection, a head count, an optional lower-triangular causal-mask buffer, attention
dropout: found by their names and shapes (:func:`structural_match`), run through the
chosen backend (:func:`structural_forward`). The parity check, not the structure,
decides: a look-alike that is not equivalent (heads mixed after the softmax, another
scale) is reverted.

Causality is read off the buffer alone. A module whose forward calls
``F.scaled_dot_product_attention`` itself and holds no such buffer (nanoGPT's flash
path: ``is_causal=True``, its ``bias`` buffer registered only without flash) is fused
already, and its causality is in the call, not in its structure: it is skipped, with
that reason in the report, rather than swapped as non-causal attention and reverted by
its check. Its SDPA calls run per document on a packed batch all the same
(:mod:`._own_calls`). So is diffusers' ``Attention`` with its default processor
(``AttnProcessor2_0`` calls SDPA), though its ``to_out`` is a ``ModuleList([Linear,
Dropout])`` that the structural forward does not run; with the classic processor it is
left to the ``traced`` family.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_speedkit.attention._example_inputs import Inputs, tokens
from lightning_speedkit.attention._own_calls import calls_sdpa

if TYPE_CHECKING:
    from lightning_speedkit.attention.adapters import SwapContext

_HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "heads", "nhead")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "kv_heads")
_FUSED_QKV = ("qkv", "in_proj", "c_attn", "Wqkv", "qkv_proj", "to_qkv", "query_key_value")
_SEPARATE_QKV = (
    ("q_proj", "k_proj", "v_proj"),
    ("query", "key", "value"),
    ("q", "k", "v"),
    ("wq", "wk", "wv"),
    ("to_q", "to_k", "to_v"),
)
_OUT_PROJ = ("o_proj", "out_proj", "proj", "c_proj", "wo", "dense", "to_out", "out")
_ATTN_DROPOUT = ("attn_drop", "attn_dropout", "attention_dropout", "dropout_attn")
_OUT_DROPOUT = ("proj_drop", "resid_dropout", "resid_drop", "out_drop", "dropout_out")


@dataclass(frozen=True)
class Structure:
    """What the structural adapter found in a custom attention module."""

    heads: int
    kv_heads: int
    head_dim: int
    qkv: str | None
    """Name of the fused projection, or ``None`` for separate ones."""
    q: str | None
    k: str | None
    v: str | None
    out: str
    causal: bool
    """A lower-triangular mask buffer was found: the attention is causal."""
    max_len: int | None
    """Side of that mask: longer sequences run the module's own forward."""
    attn_dropout: str | None
    out_dropout: str | None
    scale: float | None


def _attr(module: nn.Module, name: str) -> Any:
    """``module.<name>`` where the instance or its class holds it (a property's value
    included), ``None`` elsewhere: never through a class's ``__getattr__``, which every
    module is asked here, and diffusers' answers with its config and a deprecation
    warning (``num_attention_heads`` of a top-level model, on every swap)."""
    value = inspect.getattr_static(module, name, None)
    if hasattr(type(value), "__get__"):  # a property, or another descriptor: its value
        return getattr(module, name, None)
    return value


def _int_attr(module: nn.Module, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = _attr(module, name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _causal_buffer(module: nn.Module) -> tuple[bool, int | None]:
    for buffer in module.buffers(recurse=False):
        if buffer.ndim < 2 or buffer.shape[-1] != buffer.shape[-2] or buffer.shape[-1] < 2:
            continue
        square = buffer.reshape(-1, *buffer.shape[-2:])[0]
        if square.dtype != torch.bool:
            square = square != 0
        lower = torch.tril(torch.ones_like(square))
        if torch.equal(square, lower):
            return True, int(buffer.shape[-1])
    return False, None


def structural_match(module: nn.Module) -> Any:
    cls_module = type(module).__module__ or ""
    if cls_module.startswith(("transformers.", "timm.", "torch.")):
        return None  # those families have their own switches
    heads = _int_attr(module, _HEAD_ATTRS)
    if heads is None:
        return None
    children = dict(module.named_children())
    linear = {name for name, child in children.items() if isinstance(child, nn.Linear)}
    lin: dict[str, nn.Linear] = {name: children[name] for name in linear}  # type: ignore[misc]
    fused = next((name for name in _FUSED_QKV if name in linear), None)
    separate = next((names for names in _SEPARATE_QKV if set(names) <= linear), None)
    out = next((name for name in _OUT_PROJ if name in linear), None)
    if fused is None and separate is None:
        return None
    if out is None:
        return _fused_already(module, children)
    # From here on the module looks like attention: a refusal says why.
    name = type(module).__name__
    causal, max_len = _causal_buffer(module)
    if not causal and calls_sdpa(module):
        return f"{name}: calls SDPA itself: fused already"
    kv_heads = _int_attr(module, _KV_HEAD_ATTRS) or heads
    if fused is not None:
        inner = lin[out].in_features
        width = lin[fused].out_features
        if width != 3 * inner or inner % heads or kv_heads != heads:
            return f"{name}: fused projection {fused!r} is not three equal parts of {heads} heads"
        head_dim = inner // heads
    else:
        assert separate is not None
        q, k, v = (lin[part] for part in separate)
        if q.out_features % heads or k.out_features != v.out_features:
            return f"{name}: projections do not split into {heads} heads"
        head_dim = q.out_features // heads
        if k.out_features != kv_heads * head_dim or heads % kv_heads:
            return f"{name}: key/value projections do not match {kv_heads} key/value heads"
    attn_dropout = out_dropout = None
    known = {fused, out, *(separate or ())}
    for child_name, child in children.items():
        if child_name in known:
            continue
        if isinstance(child, nn.Dropout):
            if child_name in _ATTN_DROPOUT:
                attn_dropout = child_name
            elif child_name in _OUT_DROPOUT:
                out_dropout = child_name
            elif child.p > 0:
                return f"{name}: dropout {child_name!r} is not one the structural adapter knows"
        elif any(True for _ in child.parameters()) or not isinstance(
            child, (nn.Identity, nn.Softmax)
        ):
            return f"{name}: submodule {child_name!r} is not modelled by the structural adapter"
    scale = _attr(module, "scale")
    return Structure(
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        qkv=fused,
        q=separate[0] if separate else None,
        k=separate[1] if separate else None,
        v=separate[2] if separate else None,
        out=out,
        causal=causal,
        max_len=max_len,
        attn_dropout=attn_dropout,
        out_dropout=out_dropout,
        scale=float(scale) if isinstance(scale, float) else None,
    )


def _fused_already(module: nn.Module, children: dict[str, nn.Module]) -> str | None:
    """A module with projections whose output projection is a container led by a linear
    (diffusers' ``to_out = ModuleList([Linear, Dropout])``): not one the structural forward
    runs, but one that calls SDPA itself (through diffusers' ``AttnProcessor2_0``) is fused
    already, and says so; otherwise the ``traced`` family may find it (``None``)."""
    container = (nn.ModuleList, nn.Sequential)
    led = any(
        isinstance(child, container) and len(child) > 0 and isinstance(child[0], nn.Linear)
        for name, child in children.items()
        if name in _OUT_PROJ
    )
    if led and not _causal_buffer(module)[0] and calls_sdpa(module):
        return f"{type(module).__name__}: calls SDPA itself: fused already"
    return None


def structural_forward(ctx: SwapContext, x: Tensor, *args: Any, **kwargs: Any) -> Any:
    s: Structure = ctx.binding
    if args or any(value is not None for value in kwargs.values()) or x.ndim != 3:
        return NotImplemented  # masks or other inputs: the module's own forward
    B, N, _ = x.shape
    if s.max_len is not None and s.max_len < N:
        return NotImplemented
    module = ctx.module
    if s.qkv is not None:
        qkv = getattr(module, s.qkv)(x).view(B, N, 3, s.heads, s.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
    else:
        assert s.q is not None
        assert s.k is not None
        assert s.v is not None
        q = getattr(module, s.q)(x).view(B, N, s.heads, s.head_dim).transpose(1, 2)
        k = getattr(module, s.k)(x).view(B, N, s.kv_heads, s.head_dim).transpose(1, 2)
        v = getattr(module, s.v)(x).view(B, N, s.kv_heads, s.head_dim).transpose(1, 2)
    dropout_p = 0.0
    if s.attn_dropout is not None and module.training:
        dropout_p = float(getattr(module, s.attn_dropout).p)
    out = ctx.attend(q, k, v, is_causal=s.causal, scale=s.scale, dropout_p=dropout_p)
    out = getattr(module, s.out)(out.transpose(1, 2).reshape(B, N, s.heads * s.head_dim))
    if s.out_dropout is not None:
        out = getattr(module, s.out_dropout)(out)
    return out


def structural_example(module: nn.Module) -> Inputs | None:
    s = structural_match(module)
    if not isinstance(s, Structure):
        return None
    first = getattr(module, s.qkv or s.q or "")
    length = min(s.max_len or 16, 16)
    return (tokens(module, first.in_features, length),), {}
