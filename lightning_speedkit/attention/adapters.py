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
    equivalent (heads mixed after the softmax, another scale) is reverted: see
    :mod:`lightning_speedkit.attention._structural`.
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
from lightning_speedkit.attention import _documents
from lightning_speedkit.attention._example_inputs import Inputs, device_of, tokens
from lightning_speedkit.attention._hf_checkpointing import replaying_checkpoints
from lightning_speedkit.attention._multimodal_positions import warn_if_multimodal_rope
from lightning_speedkit.attention._structural import Structure as Structure  # a binding's class
from lightning_speedkit.attention._structural import (
    structural_example,
    structural_forward,
    structural_match,
)
from lightning_speedkit.attention._traced import traced_forward
from lightning_speedkit.attention.backends import Attend


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
        with self.attend.sdpa_kernel(device_of(self.module)):
            yield


@dataclass(frozen=True)
class AttentionAdapter:
    """One family of attention modules (see the module docstring)."""

    family: str
    match: Callable[[nn.Module], Any]
    forward: Callable[..., Any]
    example_inputs: Callable[[nn.Module], Inputs | None] | None = field(default=None)
    example_decides: bool = field(default=True)
    """Whether a failed check on ``example_inputs`` reverts the module at once (a look-alike
    caught before any call). ``False`` where the example cannot stand for the module's real
    calls: it stays pending, and its first real call's check decides (see ``_hf_example``)."""


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
    if _documents.active() is not None:
        # A packed batch: transformers' flash and flex paths keep documents apart only on
        # one row without an attention mask (they unpad by the mask, and read packing off
        # `position_ids` for a batch of one); its SDPA calls are cut per document, always.
        return "sdpa"
    device = device_of(ctx.module)
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
    warn_if_multimodal_rope(ctx.module, config, kwargs)  # a packed batch's positions
    # For the call only (the user's config keeps its implementation, a call asking for
    # attention weights runs eager), and declared: the blocks it encloses are checkpointed
    # perhaps, and recompute in backward, after the call, under this same setting.
    with _surgery.call_setting(partial(_hf_setting, ctx)):
        return ctx.original(*args, **kwargs)


@contextmanager
def _hf_setting(ctx: SwapContext) -> Iterator[None]:
    """The model's attention implementation and SDPA kernel for ``ctx``'s backend; the
    layers transformers checkpoints recompute under them (:mod:`._hf_checkpointing`)."""
    config = ctx.binding
    previous = config._attn_implementation
    _set_hf_implementation(config, _hf_implementation(ctx))
    try:
        with ctx.sdpa_kernel(), replaying_checkpoints(ctx.module, partial(_hf_setting, ctx)):
            yield
    finally:
        _set_hf_implementation(config, previous)


def _hf_example(module: nn.Module) -> Inputs | None:
    """A batch of random ``input_ids``: it checks that the model runs the backend, but does
    not decide a revert (``example_decides=False``). A transformers model builds its mask from
    the call's inputs and its config, and an outer model may hand a sub-model one of its own:
    PaliGemma gives its Gemma (``use_bidirectional_attention``) a prefix mask, while that Gemma
    called alone masks causally in eager and not at all in SDPA (0.04 apart in transformers
    itself): the example reverted it (parity error 0.12) though its real calls match."""
    config: Any = module.config
    if getattr(module, "main_input_name", None) != "input_ids" or not hasattr(config, "vocab_size"):
        return None
    device = device_of(module)
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
    return (tokens(module, qkv.in_features),), {}


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
    documents = _documents.active()
    mha: Any = ctx.module
    rows = query if mha.batch_first else query.transpose(0, 1)
    if documents is not None and query is key is value and documents.covers_rows(rows):
        masks = _mha_masks(mha, documents, attn_mask, key_padding_mask)
        with ctx.sdpa_kernel():  # a packed batch: MHA's own call on each group of documents
            return _documents.per_document_rows(
                lambda x, m, p: ctx.original(x, x, x, key_padding_mask=p, need_weights=False,
                                             attn_mask=m, is_causal=is_causal),
                documents, query, masks, batch_first=mha.batch_first,
            )  # fmt: skip
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


def _mha_masks(
    mha: Any, documents: Any, attn_mask: Tensor | None, key_padding_mask: Tensor | None
) -> Callable[[list[tuple[int, int, int]]], tuple[Tensor | None, Tensor | None]]:
    """For a group of documents, MHA's ``attn_mask`` (3-D, per head) and padding mask, cut."""
    heads = mha.num_heads

    def cut(members: list[tuple[int, int, int]]) -> tuple[Tensor | None, Tensor | None]:
        mask = padding = None
        if attn_mask is not None:
            full = attn_mask if attn_mask.ndim == 3 else attn_mask.expand(
                documents.rows * heads, *attn_mask.shape[-2:])  # fmt: skip
            mask = torch.cat([full[r * heads : (r + 1) * heads, s:e, s:e] for r, s, e in members])
        if key_padding_mask is not None:
            padding = torch.stack([key_padding_mask[r, s:e] for r, s, e in members])
        return mask, padding

    return cut


def _mha_example(module: nn.Module) -> Inputs | None:
    mha: Any = module
    x = tokens(module, mha.embed_dim)
    if not mha.batch_first:
        x = x.transpose(0, 1)
    kv_shape = (*x.shape[:-1],)
    same = _compat.mha_same_embed_dim(mha)
    k = x if same else torch.randn(*kv_shape, mha.kdim, device=x.device)
    v = x if same else torch.randn(*kv_shape, mha.vdim, device=x.device)
    return (x, k, v), {"need_weights": False}


# ------------------------------------------------------------------- registry

# Under their names from before they moved: a model pickled with a structural swap names
# its adapter's functions (and binding, ``Structure``) here.
_structural_match, _structural_forward = structural_match, structural_forward
_structural_example = structural_example

_BUILTIN: tuple[AttentionAdapter, ...] = (
    AttentionAdapter("huggingface", _hf_match, _hf_forward, _hf_example, example_decides=False),
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
