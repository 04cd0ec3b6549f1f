"""The example VLM: ViT vision encoder, MLP projector, causal language decoder.

Image patches go through the vision encoder; the projector maps them to the
decoder's width; they are prepended to the caption's token embeddings and the
decoder predicts each next caption token (LLaVA's layout, at small scale).

Attention is written plainly, with an explicit matmul, mask and softmax, as much
research code still is: the vision tower uses a fused ``qkv`` projection (as timm
does), the decoder separate ``q_proj``/``k_proj``/``v_proj`` and a
lower-triangular causal-mask buffer (as many decoders do). Nothing here knows
about lightning_speedkit.

Presets (parameter counts at the tokenizer's 35-token vocabulary; a test keeps
them current):

========  =========  ============  ==========  ===========  ============
preset    image      vision        decoder     parameters   use
========  =========  ============  ==========  ===========  ============
tiny      32, p8     64 x 2        64 x 2      229,952      CPU tests, the demo
small     64, p8     192 x 4       256 x 4     5,148,480    CPU benchmarks
base      224, p16   768 x 12      1024 x 16   289,513,728  GPU benchmarks
========  =========  ============  ==========  ===========  ============

("64 x 2": width 64, 2 blocks.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PresetName = Literal["tiny", "small", "base"]


@dataclass(frozen=True)
class VLMConfig:
    """Shape of the example VLM."""

    vocab_size: int
    """Decoder vocabulary; take it from the tokenizer."""
    image_size: int = 32
    """Side of the square input image, in pixels."""
    patch_size: int = 8
    """Side of a ViT patch; ``(image_size / patch_size) ** 2`` image tokens."""
    vision_dim: int = 64
    vision_depth: int = 2
    vision_heads: int = 4
    text_dim: int = 64
    text_depth: int = 2
    text_heads: int = 4
    max_text_len: int = 40
    """Longest caption, in tokens, including ``<bos>`` and ``<eos>``."""
    mlp_ratio: int = 4
    freeze_vision: bool = False
    """Freeze the vision tower (no gradients, no optimizer state for it)."""

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"`image_size` ({self.image_size}) must be a multiple of `patch_size` "
                f"({self.patch_size})."
            )
        for dim, heads, name in (
            (self.vision_dim, self.vision_heads, "vision"),
            (self.text_dim, self.text_heads, "text"),
        ):
            if dim % heads:
                raise ValueError(
                    f"`{name}_dim` ({dim}) must be a multiple of `{name}_heads` ({heads})."
                )

    @property
    def num_image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def preset(cls, name: PresetName, vocab_size: int, **overrides: object) -> VLMConfig:
        """One of the size presets, with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
        return replace(cls(vocab_size=vocab_size, **PRESETS[name]), **overrides)  # type: ignore[arg-type]


PRESETS: dict[str, dict[str, int]] = {
    "tiny": {},
    "small": dict(
        image_size=64,
        patch_size=8,
        vision_dim=192,
        vision_depth=4,
        vision_heads=3,
        text_dim=256,
        text_depth=4,
        text_heads=4,
    ),
    "base": dict(
        image_size=224,
        patch_size=16,
        vision_dim=768,
        vision_depth=12,
        vision_heads=12,
        text_dim=1024,
        text_depth=16,
        text_heads=16,
        max_text_len=64,
    ),
}


class VisionSelfAttention(nn.Module):
    """Bidirectional multi-head self-attention with a fused qkv projection."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (B, H, N, D) each
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        weights = scores.softmax(dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(B, N, C)
        return self.proj(out)


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v projections."""

    causal_mask: Tensor

    def __init__(self, dim: int, num_heads: int, max_len: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)
        mask = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        B, S, C = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.causal_mask[:S, :S], float("-inf"))
        weights = F.softmax(scores, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(B, S, C)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, ratio * dim)
        self.fc2 = nn.Linear(ratio * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = VisionSelfAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, mlp_ratio)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: int, max_len: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, num_heads, max_len)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, mlp_ratio)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionEncoder(nn.Module):
    """A ViT: patch embedding, learned positions, pre-norm blocks."""

    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, cfg.vision_dim, cfg.patch_size, stride=cfg.patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_image_tokens, cfg.vision_dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.blocks = nn.ModuleList(
            VisionBlock(cfg.vision_dim, cfg.vision_heads, cfg.mlp_ratio)
            for _ in range(cfg.vision_depth)
        )
        self.norm = nn.LayerNorm(cfg.vision_dim)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class Projector(nn.Module):
    """Two-layer MLP from vision width to decoder width (LLaVA-1.5's projector)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, out_dim)
        self.fc2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class LanguageModel(nn.Module):
    """A GPT-style decoder that reads a prefix of embeddings before the tokens."""

    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        max_len = cfg.num_image_tokens + cfg.max_text_len
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.text_dim)
        self.embed_positions = nn.Embedding(max_len, cfg.text_dim)
        self.blocks = nn.ModuleList(
            DecoderBlock(cfg.text_dim, cfg.text_heads, cfg.mlp_ratio, max_len)
            for _ in range(cfg.text_depth)
        )
        self.norm = nn.LayerNorm(cfg.text_dim)
        self.lm_head = nn.Linear(cfg.text_dim, cfg.vocab_size, bias=False)

    def forward(self, input_ids: Tensor, prefix: Tensor) -> Tensor:
        """Logits for the positions of ``input_ids`` (shape ``(B, T, vocab)``)."""
        x = torch.cat([prefix, self.embed_tokens(input_ids)], dim=1)
        positions = torch.arange(x.shape[1], device=x.device)
        x = x + self.embed_positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x[:, prefix.shape[1] :]))


class VLM(nn.Module):
    """Vision encoder + projector + causal decoder.

    Example::

        >>> cfg = VLMConfig.preset("tiny", vocab_size=35)
        >>> model = VLM(cfg)
        >>> logits = model(torch.zeros(2, 3, 32, 32), torch.zeros(2, 7, dtype=torch.long))
        >>> tuple(logits.shape)
        (2, 7, 35)
    """

    def __init__(self, cfg: VLMConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision = VisionEncoder(cfg)
        self.projector = Projector(cfg.vision_dim, cfg.text_dim)
        self.language_model = LanguageModel(cfg)
        self.apply(_init_weights)
        if cfg.freeze_vision:
            self.vision.requires_grad_(False)

    def forward(self, images: Tensor, input_ids: Tensor) -> Tensor:
        prefix = self.projector(self.vision(images))
        logits: Tensor = self.language_model(input_ids, prefix)
        return logits


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
