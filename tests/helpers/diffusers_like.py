"""Small torch modules laid out as diffusers 0.3x-0.4x lays out its models, for tests
that cannot import diffusers.

What is copied, because the kit's behaviour depends on it:

- ``Attention``: ``to_q``/``to_k``/``to_v`` linears, ``to_out = ModuleList([Linear,
  Dropout])``, a ``heads`` count, a ``scale``, and a ``processor`` object (not a module)
  that its ``forward`` calls. :class:`ClassicProcessor` is diffusers' ``AttnProcessor``
  (heads folded into the batch; scores by ``torch.baddbmm`` with ``beta=0`` and an empty
  first tensor, or ``beta=1`` and the additive mask), :class:`SdpaProcessor` its default
  ``AttnProcessor2_0`` (``F.scaled_dot_product_attention``).
- Gradient checkpointing: a module that can checkpoint has a ``gradient_checkpointing``
  flag and a ``_gradient_checkpointing_func``, set by the model's
  :meth:`ModelMixin.enable_gradient_checkpointing`, and calls
  ``self._gradient_checkpointing_func(block, *args)`` on its blocks when the flag is on
  and gradients are enabled (diffusers' default function checkpoints ``block.__call__``,
  non-reentrant).
- The config: a top-level model keeps its config in ``_internal_dict``, and reading a
  config key as an attribute (``model.num_attention_heads``) warns, as diffusers'
  ``ModelMixin.__getattr__`` does (a ``FutureWarning``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn


class ClassicProcessor:
    """diffusers' ``AttnProcessor``: the attention written out, heads folded into the batch."""

    def __call__(
        self,
        attn: Attention,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        batch, length, _ = (
            hidden_states if encoder_hidden_states is None else encoder_hidden_states
        ).shape
        attention_mask = attn.prepare_attention_mask(attention_mask, length, batch)
        query = attn.to_q(hidden_states)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        key, value = attn.to_k(context), attn.to_v(context)
        query, key, value = (attn.head_to_batch_dim(t) for t in (query, key, value))
        probs = attn.get_attention_scores(query, key, attention_mask)
        hidden_states = attn.batch_to_head_dim(torch.bmm(probs, value))
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        return hidden_states / attn.rescale_output_factor


class SdpaProcessor:
    """diffusers' ``AttnProcessor2_0`` (its default): one ``F.scaled_dot_product_attention``."""

    def __call__(
        self,
        attn: Attention,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        batch, length, _ = context.shape
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, length, batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])
        query, key, value = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (
            t.view(batch, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value)
        )
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim)
        out = attn.to_out[1](attn.to_out[0](out))
        return out / attn.rescale_output_factor


class Attention(nn.Module):
    """diffusers' ``Attention``: its forward hands everything to ``self.processor``."""

    def __init__(
        self,
        query_dim: int,
        cross_attention_dim: int | None = None,
        heads: int = 4,
        dim_head: int = 8,
        processor: Any = None,
    ) -> None:
        super().__init__()
        inner = heads * dim_head
        context = query_dim if cross_attention_dim is None else cross_attention_dim
        self.heads, self.scale, self.rescale_output_factor = heads, dim_head**-0.5, 1.0
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(context, inner, bias=False)
        self.to_v = nn.Linear(context, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim), nn.Dropout(0.0)])
        self.processor = SdpaProcessor() if processor is None else processor

    def forward(
        self,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ) -> Tensor:
        out: Tensor = self.processor(self, hidden_states, encoder_hidden_states, attention_mask)
        return out

    def head_to_batch_dim(self, tensor: Tensor) -> Tensor:
        batch, length, dim = tensor.shape
        tensor = tensor.reshape(batch, length, self.heads, dim // self.heads).permute(0, 2, 1, 3)
        return tensor.reshape(batch * self.heads, length, dim // self.heads)

    def batch_to_head_dim(self, tensor: Tensor) -> Tensor:
        batch, length, dim = tensor.shape
        tensor = tensor.reshape(batch // self.heads, self.heads, length, dim).permute(0, 2, 1, 3)
        return tensor.reshape(batch // self.heads, length, dim * self.heads)

    def prepare_attention_mask(
        self, attention_mask: Tensor | None, target_length: int, batch_size: int
    ) -> Tensor | None:
        """``(batch, 1, keys)`` additive mask to ``(batch * heads, 1, keys)``."""
        if attention_mask is None:
            return None
        if attention_mask.shape[0] < batch_size * self.heads:
            attention_mask = attention_mask.repeat_interleave(self.heads, dim=0)
        return attention_mask

    def get_attention_scores(
        self, query: Tensor, key: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        if attention_mask is None:
            shape = (query.shape[0], query.shape[1], key.shape[1])
            baddbmm_input = torch.empty(shape, dtype=query.dtype, device=query.device)
            beta = 0
        else:
            baddbmm_input, beta = attention_mask, 1
        scores = torch.baddbmm(
            baddbmm_input, query, key.transpose(-1, -2), beta=beta, alpha=self.scale
        )
        return scores.softmax(dim=-1).to(query.dtype)


class TransformerBlock(nn.Module):
    """diffusers' ``BasicTransformerBlock``, cut down: self-attention, cross-attention, MLP."""

    def __init__(self, dim: int, context_dim: int, processor: Callable[[], Any]) -> None:
        super().__init__()
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(dim) for _ in range(3))
        self.attn1 = Attention(dim, heads=4, dim_head=dim // 4, processor=processor())
        self.attn2 = Attention(dim, context_dim, heads=4, dim_head=dim // 4, processor=processor())
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(
        self,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        encoder_attention_mask: Tensor | None = None,
    ) -> Tensor:
        hidden_states = hidden_states + self.attn1(self.norm1(hidden_states))
        hidden_states = hidden_states + self.attn2(
            self.norm2(hidden_states), encoder_hidden_states, encoder_attention_mask
        )
        return hidden_states + self.ff(self.norm3(hidden_states))  # type: ignore[no-any-return]


def _checkpoint_call(module: Callable[..., Any], *args: Any) -> Any:
    """diffusers' default ``_gradient_checkpointing_func``."""
    return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False)


class ModelMixin(nn.Module):
    """diffusers' ``ModelMixin``, the two parts the kit meets: gradient checkpointing and
    the deprecated reading of config keys as attributes."""

    def __init__(self, **config: Any) -> None:
        super().__init__()
        self._internal_dict = dict(config)
        self._gradient_checkpointing_func: Callable[..., Any] | None = None

    def __getattr__(self, name: str) -> Any:
        if "_internal_dict" in self.__dict__ and name in self.__dict__["_internal_dict"]:
            warnings.warn(
                f"Accessing config attribute `{name}` directly via '{type(self).__name__}' "
                "object attribute is deprecated.",
                FutureWarning,
                stacklevel=2,
            )
            return self.__dict__["_internal_dict"][name]
        return super().__getattr__(name)

    def enable_gradient_checkpointing(self, function: Callable[..., Any] | None = None) -> None:
        for module in self.modules():
            if hasattr(module, "gradient_checkpointing"):
                module._gradient_checkpointing_func = function or _checkpoint_call
                module.gradient_checkpointing = True


class Transformer2D(ModelMixin):
    """diffusers' ``Transformer2DModel`` / PixArt, cut down: blocks over a token sequence,
    checkpointed by the model when its gradient checkpointing is on."""

    def __init__(
        self,
        dim: int = 32,
        context_dim: int = 24,
        layers: int = 2,
        processor: Callable[[], Any] = SdpaProcessor,
    ) -> None:
        super().__init__(num_attention_heads=4, attention_head_dim=dim // 4, num_layers=layers)
        self.proj_in = nn.Linear(dim, dim)
        self.transformer_blocks = nn.ModuleList(
            TransformerBlock(dim, context_dim, processor) for _ in range(layers)
        )
        self.proj_out = nn.Linear(dim, dim)
        self.gradient_checkpointing = False

    def forward(
        self,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor,
        encoder_attention_mask: Tensor | None = None,
    ) -> Tensor:
        if encoder_attention_mask is not None:  # PixArt: keep 1, drop 0 -> additive
            encoder_attention_mask = (1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0
            encoder_attention_mask = encoder_attention_mask.unsqueeze(1)
        hidden_states = self.proj_in(hidden_states)
        for block in self.transformer_blocks:
            args = (hidden_states, encoder_hidden_states, encoder_attention_mask)
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                assert self._gradient_checkpointing_func is not None
                hidden_states = self._gradient_checkpointing_func(block, *args)
            else:
                hidden_states = block(*args)
        return self.proj_out(hidden_states)  # type: ignore[no-any-return]


def set_processor(model: nn.Module, processor: Callable[[], Any]) -> None:
    """``model.set_attn_processor``: every attention gets a new ``processor()``."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.processor = processor()
