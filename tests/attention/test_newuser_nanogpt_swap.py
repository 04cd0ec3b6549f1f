"""karpathy's nanoGPT as written, under AttentionSwap: its flash attention is fused already.

nanoGPT's ``CausalSelfAttention`` calls ``F.scaled_dot_product_attention(...,
is_causal=True)`` and registers its causal ``bias`` buffer only when SDPA is missing. Its
structure (``c_attn``, ``c_proj``, ``n_head``) is the structural family's, but without the
buffer its causality is in the call: it is skipped with the reason, quietly, where it was
swapped as non-causal attention, failed its check and was reverted with a warning per
layer. Packed, its own SDPA calls still run per document.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F
from torch.nn.functional import scaled_dot_product_attention as sdpa
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap, swap_attention
from lightning_speedkit.data import PackingCollate

REASON = "CausalSelfAttention: calls SDPA itself: fused already"


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 50
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    """nanoGPT's model.py, verbatim but for the comments."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.flash = hasattr(torch.nn.functional, "scaled_dot_product_attention")
        if not self.flash:
            n = config.block_size
            self.register_buffer("bias", torch.tril(torch.ones(n, n)).view(1, 1, n, n))

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                is_causal=True,
            )  # fmt: skip
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class WithoutFlash(CausalSelfAttention):
    """nanoGPT on a torch without SDPA: the ``bias`` buffer, the softmax written out."""

    def __init__(self, config: GPTConfig) -> None:
        nn.Module.__init__(self)
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout
        self.flash = False
        n = config.block_size
        self.register_buffer("bias", torch.tril(torch.ones(n, n)).view(1, 1, n, n))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's GPT: learned positions from its own ``torch.arange(t)``, tied head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))  # fmt: skip
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: Tensor) -> Tensor:
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class _Task(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.model = GPT(GPTConfig())
        self.lr = lr
        self.losses: list[Tensor] = []

    def _losses(self, batch: Any) -> Tensor:
        """Per-token losses of the real tokens, in document order."""
        ids, labels = (batch["input_ids"], batch["labels"]) if isinstance(batch, dict) else batch
        logits = self.model(ids)
        losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        return losses[labels.flatten() != -100]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        losses = self._losses(batch)
        self.losses.append(losses.detach().clone())
        return losses.mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def _fit(task: _Task, loader: DataLoader, callbacks: list[Any], steps: int = 3) -> L.Trainer:
    trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)  # fmt: skip
    trainer.fit(task, loader)
    return trainer


def _kept_own(caught: Any) -> list[str]:
    return [str(w.message) for w in caught if "kept" in str(w.message)]


def test_swap_attention_skips_nanogpts_flash_attention_with_the_reason_quietly(
    recwarn: pytest.WarningsRecorder,
) -> None:
    report = swap_attention(GPT(GPTConfig()), "sdpa")
    assert report.skipped == [(f"transformer.h.{i}.attn", REASON) for i in range(2)]
    assert report.reverted == []
    assert report.swapped == []
    assert _kept_own(recwarn) == []


def test_attention_swap_fit_on_nanogpt_keeps_its_losses_and_warns_nothing(
    recwarn: pytest.WarningsRecorder,
) -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (24, 13), generator=g)
    loader = DataLoader(list(zip(tokens[:, :-1], tokens[:, 1:], strict=True)), batch_size=8)
    torch.manual_seed(0)
    plain = _Task(lr=1e-2)
    _fit(plain, loader, [])
    torch.manual_seed(0)
    task = _Task(lr=1e-2)
    swap = AttentionSwap(verbose=False)
    trainer = _fit(task, loader, [swap])
    assert swap.report is not None
    assert swap.report.skipped == [(f"model.transformer.h.{i}.attn", REASON) for i in range(2)]
    assert swap.report.reverted == []
    assert trainer.callback_metrics["attention/reverted"].item() == 0.0
    assert _kept_own(recwarn) == []
    assert len(task.losses) == len(plain.losses) == 3
    for swapped, own in zip(task.losses, plain.losses, strict=True):
        assert (swapped - own).abs().max().item() <= 1e-6


def test_packed_nanogpt_losses_equal_each_document_alone() -> None:
    """Its own SDPA calls run per document, its ``wpe(arange(t))`` restarts per document."""
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 50, (int(n),), generator=g) for n in (6, 4, 8, 3, 5, 7, 9, 2)]
    samples = [{"input_ids": d[:-1], "labels": d[1:]} for d in docs]
    loader = DataLoader(samples, batch_size=4, collate_fn=PackingCollate(max_tokens=12))
    torch.manual_seed(0)
    task = _Task(lr=0.0)
    swap = AttentionSwap(verbose=False)
    _fit(task, loader, [swap], steps=len(loader))
    assert swap.report is not None
    assert swap.report.reverted == []
    assert len(task.losses) == 2
    with torch.no_grad():
        alone = torch.cat([
            F.cross_entropy(task.model(s["input_ids"][None])[0], s["labels"], reduction="none")
            for s in samples
        ])  # fmt: skip
    packed = torch.cat(task.losses)
    assert packed.shape == alone.shape
    assert (packed - alone).abs().max().item() <= 1e-5
    with torch.no_grad():  # the same rows, their documents not kept apart: they mix
        rows = [PackingCollate(max_tokens=12)(samples[i : i + 4]) for i in (0, 4)]
        mixed = torch.cat([task._losses(b) for b in rows])
    assert (mixed - alone).abs().max().item() > 1e-2


def test_without_flash_its_causal_buffer_makes_it_swapped_causal() -> None:
    config = GPTConfig()
    module = WithoutFlash(config)
    x = torch.randn(2, 10, config.n_embd)
    report = swap_attention(module, "sdpa", sample=x)
    assert [(m.family, m.status) for m in report.modules] == [("structural", "active")]
    assert report.modules[0].parity_error is not None
    assert report.modules[0].parity_error <= 1e-4


class _Encoder(nn.Module):
    """Non-causal attention written out: projections, a head count, its own softmax."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.num_heads = heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.o_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = (p(x).view(B, N, self.num_heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        weights = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(B, N, C))


class _AliasedSdpa(_Encoder):
    """SDPA under a name of its own (``from ... import scaled_dot_product_attention as sdpa``)."""

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = (p(x).view(B, N, self.num_heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        return self.o_proj(sdpa(q, k, v, is_causal=True).transpose(1, 2).reshape(B, N, C))


class _TimmLike(nn.Module):
    """timm's ``Attention``: its ``fused_attn`` switch is the timm family's, SDPA or not."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.fused_attn = heads, False
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        if self.fused_attn:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            y = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, N, C))


def test_non_causal_attention_written_out_is_still_swapped() -> None:
    report = swap_attention(_Encoder(), "sdpa", sample=torch.randn(2, 10, 32))
    assert [(m.family, m.status) for m in report.modules] == [("structural", "active")]


def test_sdpa_called_under_another_name_is_skipped_too() -> None:
    report = swap_attention(_AliasedSdpa(), "sdpa", sample=torch.randn(2, 10, 32))
    assert report.skipped == [("", "_AliasedSdpa: calls SDPA itself: fused already")]
    assert report.modules == []


def test_the_timm_family_still_takes_a_module_that_calls_sdpa() -> None:
    report = swap_attention(_TimmLike(), "sdpa", sample=torch.randn(2, 10, 32))
    assert [(m.family, m.status) for m in report.modules] == [("timm", "active")]
