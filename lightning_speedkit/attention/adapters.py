"""Attention adapters: how each family of attention module runs a fused backend.

An adapter is three functions (see :func:`register_adapter`):

* ``match(module)`` says whether a module belongs to the family: ``None`` (not
  ours), a string (ours, but it cannot be swapped: the reason lands in the
  report's ``skipped``), or any other object, the *binding*, handed back to
  ``forward`` as ``ctx.binding`` (what ``match`` learned about the module).
* ``forward(ctx, *args, **kwargs)`` computes what the module's own forward
  would, through ``ctx.attend`` (an :class:`~lightning_speedkit.attention.backends.Attend`)
  or by calling ``ctx.original`` inside ``ctx.sdpa_kernel()`` for code that
  calls SDPA itself. It returns ``NotImplemented`` for a call it does not
  handle (attention weights asked for, an unknown mask): the module's own
  forward then runs that call.
* ``example_inputs(module)`` (optional) builds a small input for checking
  parity when :func:`swap_attention` is given no sample.

Built in, tried in this order after any registered adapter:

``huggingface``
    transformers models, through their attention-implementation switch, per
    sub-model (a vision tower without SDPA support keeps its own attention).
``timm``
    modules with a boolean ``fused_attn`` switch (timm's ``Attention`` and its
    many copies).
``multihead_attention``
    ``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer`` and
    torchvision's ViT) when called with ``need_weights=False``.
``structural``
    custom self-attention found by structure: query/key/value projections
    (fused or separate, grouped key/value heads), an output projection, a head
    count, an optional lower-triangular causal-mask buffer, attention dropout.
    The parity check, not the structure, decides: a look-alike that is not
    equivalent (heads mixed after the softmax, another scale) is reverted.
``traced``
    any other module, found by what it computes on its first call (two products
    around a softmax over the key axis, fed by projections), whatever its names:
    see :mod:`lightning_speedkit.attention._traced`. It has no ``match``:
    :func:`~lightning_speedkit.swap_attention` probes the modules no other
    family claims.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_speedkit import _compat, _imports, _surgery, _validation
from lightning_speedkit.attention._traced import traced_forward
from lightning_speedkit.attention.backends import Attend

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class SwapContext:
    """What an adapter's ``forward`` gets besides the call's own arguments."""

    module: nn.Module
    """The attention module being run."""
    original: Callable[..., Any]
    """The module's own forward, bound to it."""
    attend: Attend
    """Attention through the chosen backend, in SDPA's ``(B, H, N, D)`` layout."""
    binding: Any
    """What the adapter's ``match`` returned for this module."""
    checking: bool = False
    """The parity check is running this call: a forward that could only run it unfused
    may raise :class:`~lightning_speedkit.attention._traced.SwapRefusedError` (the module then
    keeps its own forward)."""

    @property
    def backend(self) -> str:
        return self.attend.backend

    @contextmanager
    def sdpa_kernel(self) -> Iterator[None]:
        """Run SDPA calls inside on the chosen backend's kernel."""
        with self.attend.sdpa_kernel(_device_of(self.module)):
            yield


@dataclass(frozen=True)
class AttentionAdapter:
    """One family of attention modules (see the module docstring)."""

    family: str
    match: Callable[[nn.Module], Any]
    forward: Callable[..., Any]
    example_inputs: Callable[[nn.Module], Inputs | None] | None = field(default=None)


def _device_of(module: nn.Module) -> torch.device | None:
    for tensor in module.parameters():
        return tensor.device
    return None


# ---------------------------------------------------------------- huggingface


def _is_transformers_model(module: nn.Module) -> bool:
    if "transformers" not in sys.modules:  # a transformers model imported it already
        return False
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)


def _hf_match(module: nn.Module) -> Any:
    if not _is_transformers_model(module):
        return None
    if not getattr(type(module), "_supports_sdpa", False):
        return f"{type(module).__name__} has no SDPA attention in transformers"
    return module.config


def _hf_implementation(ctx: SwapContext) -> str:
    device = _device_of(ctx.module)
    cuda = device is not None and device.type == "cuda"
    cls = type(ctx.module)
    flash_support = getattr(cls, "_supports_flash_attn", False) or getattr(
        cls, "_supports_flash_attn_2", False
    )
    if ctx.backend == "flash" and cuda and _imports.FLASH_ATTN_AVAILABLE and flash_support:
        return "flash_attention_2"
    if ctx.backend == "flex" and cuda and getattr(cls, "_supports_flex_attn", False):
        return "flex_attention"
    return "sdpa"


def _set_hf_implementation(config: Any, implementation: str | None) -> None:
    # The internal attribute sets this config only; the public setter would also
    # rewrite the sub-configs, which belong to sub-models we swap (or skip) apart.
    if hasattr(config, "_attn_implementation_internal"):
        config._attn_implementation_internal = implementation
    else:
        config._attn_implementation = implementation


def _hf_forward(ctx: SwapContext, *args: Any, **kwargs: Any) -> Any:
    config = ctx.binding
    if kwargs.get("output_attentions") or getattr(config, "output_attentions", False):
        return NotImplemented  # attention weights exist in eager attention only
    # For the call only (the user's config keeps its implementation, a call asking for
    # attention weights runs eager), and declared: the blocks it encloses are checkpointed
    # perhaps, and recompute in backward, after the call, under this same setting.
    with _surgery.call_setting(partial(_hf_setting, ctx)):
        return ctx.original(*args, **kwargs)


@contextmanager
def _hf_setting(ctx: SwapContext) -> Iterator[None]:
    """The model's attention implementation and SDPA kernel for ``ctx``'s backend."""
    config = ctx.binding
    previous = config._attn_implementation
    _set_hf_implementation(config, _hf_implementation(ctx))
    try:
        with ctx.sdpa_kernel():
            yield
    finally:
        _set_hf_implementation(config, previous)


def _hf_example(module: nn.Module) -> Inputs | None:
    config: Any = module.config
    if getattr(module, "main_input_name", None) != "input_ids" or not hasattr(config, "vocab_size"):
        return None
    device = _device_of(module)
    vocab = int(config.vocab_size)
    return (torch.randint(0, vocab, (2, 8), device=device),), {}


# ----------------------------------------------------------------------- timm


def _switch_match(module: nn.Module) -> Any:
    return True if isinstance(getattr(module, "fused_attn", None), bool) else None


def _switch_forward(ctx: SwapContext, *args: Any, **kwargs: Any) -> Any:
    module: Any = ctx.module
    previous = module.fused_attn
    module.fused_attn = True
    try:
        with ctx.sdpa_kernel():
            return ctx.original(*args, **kwargs)
    finally:
        module.fused_attn = previous


def _switch_example(module: nn.Module) -> Inputs | None:
    qkv = getattr(module, "qkv", None)
    if not isinstance(qkv, nn.Linear):
        return None
    return (_tokens(module, qkv.in_features),), {}


# ------------------------------------------------------- multihead_attention


def _mha_match(module: nn.Module) -> Any:
    return True if isinstance(module, nn.MultiheadAttention) else None


def _mha_forward(
    ctx: SwapContext,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> Any:
    if need_weights:
        return NotImplemented  # the weights come from MHA's own math path
    with ctx.sdpa_kernel():
        return ctx.original(
            query,
            key,
            value,
            key_padding_mask=key_padding_mask,
            need_weights=False,
            attn_mask=attn_mask,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )


def _mha_example(module: nn.Module) -> Inputs | None:
    mha: Any = module
    x = _tokens(module, mha.embed_dim)
    if not mha.batch_first:
        x = x.transpose(0, 1)
    kv_shape = (*x.shape[:-1],)
    same = _compat.mha_same_embed_dim(mha)
    k = x if same else torch.randn(*kv_shape, mha.kdim, device=x.device)
    v = x if same else torch.randn(*kv_shape, mha.vdim, device=x.device)
    return (x, k, v), {"need_weights": False}


# ----------------------------------------------------------------- structural

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


def _int_attr(module: nn.Module, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(module, name, None)
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


def _structural_match(module: nn.Module) -> Any:
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
    if (fused is None and separate is None) or out is None:
        return None
    # From here on the module looks like attention: a refusal says why.
    name = type(module).__name__
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
    causal, max_len = _causal_buffer(module)
    scale = getattr(module, "scale", None)
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


def _structural_forward(ctx: SwapContext, x: Tensor, *args: Any, **kwargs: Any) -> Any:
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


def _structural_example(module: nn.Module) -> Inputs | None:
    s = _structural_match(module)
    if not isinstance(s, Structure):
        return None
    first = getattr(module, s.qkv or s.q or "")
    length = min(s.max_len or 16, 16)
    return (_tokens(module, first.in_features, length),), {}


def _tokens(module: nn.Module, width: int, length: int = 16) -> Tensor:
    device = _device_of(module)
    dtype = next((p.dtype for p in module.parameters()), torch.float32)
    generator = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn(2, length, width, generator=generator, dtype=dtype).to(device)


# ------------------------------------------------------------------- registry

_BUILTIN: tuple[AttentionAdapter, ...] = (
    AttentionAdapter("huggingface", _hf_match, _hf_forward, _hf_example),
    AttentionAdapter("timm", _switch_match, _switch_forward, _switch_example),
    AttentionAdapter("multihead_attention", _mha_match, _mha_forward, _mha_example),
    AttentionAdapter("structural", _structural_match, _structural_forward, _structural_example),
)


def _matched_by_discovery(module: nn.Module) -> None:
    """The ``traced`` family matches no module by looking at it: discovery finds them."""
    return None


#: Modules found by :mod:`._traced`'s discovery, not by a ``match``. Every function of an
#: adapter is a module-level one: a swap holds its adapter, and a model pickles with it.
TRACED = AttentionAdapter("traced", _matched_by_discovery, traced_forward)
_REGISTERED: list[AttentionAdapter] = []


def register_adapter(
    family: str,
    match: Callable[[nn.Module], Any],
    forward: Callable[..., Any],
    *,
    example_inputs: Callable[[nn.Module], Inputs | None] | None = None,
) -> AttentionAdapter:
    """Teach :func:`swap_attention` a family of attention modules it does not know.

    Registered adapters are tried before the built-in ones, latest first; a
    family registered again replaces the earlier adapter.

    Args:
        family: a name for the report.
        match: ``module -> None | str | binding``: ``None`` if the module is not
            of this family, a string saying why it cannot be swapped, or any
            other object (``True`` will do), handed to ``forward`` as ``ctx.binding``.
        forward: ``(ctx, *args, **kwargs) -> output``: the module's forward,
            with attention through ``ctx.attend(q, k, v, is_causal=..., scale=...,
            attn_mask=..., dropout_p=...)`` on ``(B, H, N, D)`` tensors.
            Use the module's parameters through ``ctx.module`` (never copies:
            the optimizer holds them). Return ``NotImplemented`` to run the
            module's own forward for a call.
        example_inputs: ``module -> (args, kwargs)``, a small input for the
            parity check when no sample is given.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> class Attention(nn.Module):  # heads in ``self.h``: only a trace would find it
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.h, self.to_qkv, self.to_out = 2, nn.Linear(8, 24), nn.Linear(8, 8)
        ...     def forward(self, x):
        ...         B, N, C = x.shape
        ...         qkv = self.to_qkv(x).view(B, N, 3, self.h, C // self.h)
        ...         q, k, v = qkv.permute(2, 0, 3, 1, 4)
        ...         w = (q @ k.transpose(-1, -2) * (C // self.h) ** -0.5).softmax(-1)
        ...         return self.to_out((w @ v).transpose(1, 2).reshape(B, N, C))
        >>> def forward(ctx, x):
        ...     B, N, C = x.shape
        ...     m = ctx.module
        ...     q, k, v = m.to_qkv(x).view(B, N, 3, m.h, C // m.h).permute(2, 0, 3, 1, 4)
        ...     return m.to_out(ctx.attend(q, k, v).transpose(1, 2).reshape(B, N, C))
        >>> def match(module):
        ...     return True if isinstance(module, Attention) else None
        >>> _ = register_adapter("my_attention", match, forward)
        >>> from lightning_speedkit import swap_attention
        >>> report = swap_attention(nn.Sequential(Attention()), sample=torch.randn(2, 5, 8))
        >>> report.swapped, report.modules[0].family
        (['0'], 'my_attention')
        >>> unregister_adapter("my_attention")
    """
    _validation.text("family", family, example="my_attention")
    builtin = [adapter.family for adapter in (*_BUILTIN, TRACED)]
    if family in builtin:
        fix = f"choose another name (the built-in ones are {', '.join(builtin)})"
        _validation.fail("family", family, "is the name of a built-in family", fix)
    _validation.function("match", match,
                         fix="pass `module -> None | str | binding`, e.g. `lambda m: True if "
                         "isinstance(m, MyAttention) else None`")  # fmt: skip
    _validation.function("forward", forward,
                         fix="pass `(ctx, *args, **kwargs) -> output`, the module's forward "
                         "with attention through `ctx.attend`")  # fmt: skip
    _validation.optional(_validation.function, "example_inputs", example_inputs,
                         fix="pass `module -> (args, kwargs)`, or None")  # fmt: skip
    adapter = AttentionAdapter(family, match, forward, example_inputs)
    unregister_adapter(family)
    _REGISTERED.insert(0, adapter)
    return adapter


def unregister_adapter(family: str) -> None:
    """Forget a registered adapter (built-in families stay)."""
    _REGISTERED[:] = [adapter for adapter in _REGISTERED if adapter.family != family]


def adapters() -> tuple[AttentionAdapter, ...]:
    """Every adapter in the order :func:`swap_attention` tries them."""
    return (*_REGISTERED, *_BUILTIN)
