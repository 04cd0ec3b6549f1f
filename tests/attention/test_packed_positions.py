"""Packed batches on models that build their own positions and call SDPA themselves.

Custom Llama- and nanoGPT-style decoders (not Hugging Face): rotary tables from the
model's own ``torch.arange(T)`` or sliced from a precomputed ``freqs_cis`` buffer, their
attention one ``F.scaled_dot_product_attention`` call, which no family swaps. Packed,
each document's per-token losses and gradients equal those of the document alone.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap, swap_attention
from lightning_speedkit.attention import _own_calls, packed_documents
from lightning_speedkit.data import PackingCollate

VOCAB, LENGTHS, MAX_TOKENS = 50, (5, 3, 7, 2, 4, 6), 12


class Rotary(nn.Module):
    """A rotary table built on every call from ``torch.arange`` (modded-nanoGPT's)."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2).float() / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        t = torch.arange(x.shape[2], device=x.device).type_as(self.inv_freq)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos()[None, None], emb.sin()[None, None]


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class RotaryAttention(nn.Module):
    """Rotary built inside the attention module, then one SDPA call."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.v_proj, self.o_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.rotary = Rotary(dim // heads)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        cos, sin = self.rotary(q)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))


class RotaryBlock(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), RotaryAttention(dim)
        self.ln_2, self.mlp = nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, dim), nn.GELU())

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class RotaryGPT(nn.Module):
    """nanoGPT with rotary positions its attention builds from ``torch.arange(T)``."""

    def __init__(self, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, dim)
        self.h = nn.ModuleList(RotaryBlock(dim) for _ in range(layers))
        self.lm_head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.wte(input_ids)
        for block in self.h:
            x = block(x)
        return self.lm_head(x)


def _apply_rotary(xq: Tensor, xk: Tensor, freqs_cis: Tensor) -> tuple[Tensor, Tensor]:
    """Meta's Llama: complex rotation, the table broadcast as ``(1, T, 1, D / 2)``."""
    q = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    k = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = freqs_cis.view(1, q.shape[1], 1, q.shape[-1])
    return torch.view_as_real(q * f).flatten(3), torch.view_as_real(k * f).flatten(3)


class LlamaAttention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor, freqs_cis: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.heads, self.head_dim)
        k = self.wk(x).view(B, T, self.kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.kv_heads, self.head_dim)
        q, k = _apply_rotary(q, k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(dim), LlamaAttention(dim)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = nn.Sequential(nn.Linear(dim, 64), nn.SiLU(), nn.Linear(64, dim))

    def forward(self, x: Tensor, freqs_cis: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class MetaLlama(nn.Module):
    """Meta's Llama layout: ``freqs_cis`` precomputed once, sliced ``[:T]`` in forward."""

    def __init__(self, dim: int = 32, layers: int = 2, max_len: int = 1100) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim) for _ in range(layers))
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, VOCAB, bias=False)
        head_dim = dim // 4
        freqs = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(max_len).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), False)

    def forward(self, input_ids: Tensor) -> Tensor:
        h = self.tok_embeddings(input_ids)
        freqs_cis = self.freqs_cis[: input_ids.shape[1]]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


MODELS = {"rotary_arange": RotaryGPT, "freqs_cis_buffer": MetaLlama}


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[kind]()
    swap_attention(model, "sdpa")  # skips their attention: it calls SDPA already
    return model


def _samples(lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g),
             "labels": torch.randint(0, VOCAB, (n,), generator=g)} for n in lengths]  # fmt: skip


def _token_losses(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    labels = batch["labels"].flatten()
    losses = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), labels, reduction="none")
    return losses[labels != -100]


def _one_by_one(model: nn.Module, samples: list[dict[str, Tensor]]) -> Tensor:
    return torch.cat([F.cross_entropy(model(s["input_ids"][None])[0], s["labels"],
                                      reduction="none") for s in samples])  # fmt: skip


def _grads(model: nn.Module, loss: Tensor) -> dict[str, Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("max_tokens", [MAX_TOKENS, sum(LENGTHS)], ids=["3rows", "flattened"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_rotary_positions_a_model_builds_itself_equal_one_by_one(
    kind: str, max_tokens: int
) -> None:
    model = _model(kind)
    samples = _samples()
    batch = PackingCollate(max_tokens=max_tokens)(samples)
    assert batch["input_ids"].shape[0] == (3 if max_tokens == MAX_TOKENS else 1)
    reference = _one_by_one(model, samples)
    reference_grads = _grads(model, reference.sum())
    leak = (_token_losses(model, batch) - reference).abs().max().item()
    with packed_documents(batch):
        packed = _token_losses(model, batch)
        packed_grads = _grads(model, packed.sum())
    assert leak > 1e-2  # without the documents, the model's own SDPA mixed them
    assert packed.shape == reference.shape == (sum(LENGTHS),)
    assert (packed - reference).abs().max().item() <= 1e-5
    assert _max_diff(packed_grads, reference_grads) <= 1e-5


@pytest.mark.parametrize("kind", list(MODELS))
def test_rotary_documents_far_into_a_long_row_equal_one_by_one(kind: str) -> None:
    """Rotary only sees a query's distance to a key: a document 1000 tokens into its row
    gets the angles of its own positions, up to their rounding."""
    model = _model(kind)
    samples = _samples((1000, 30, 40))
    batch = PackingCollate(max_tokens=1070)(samples)
    assert batch["cu_seqlens"].tolist() == [0, 1000, 1030, 1070]
    with torch.no_grad():
        reference = _one_by_one(model, samples)
        with packed_documents(batch):
            packed = _token_losses(model, batch)
    assert (packed - reference).abs().max().item() <= 1e-5


def test_a_position_table_added_over_the_packed_rows_is_named_once() -> None:
    """A sinusoidal table sliced ``pe[:T]`` and added: absolute, it cannot restart."""

    class Sinusoidal(RotaryGPT):
        def __init__(self) -> None:
            super().__init__()
            position, dim = torch.arange(64).float()[:, None], 32
            div = torch.exp(torch.arange(0, dim, 2).float() * (-math.log(10000.0) / dim))
            pe = torch.zeros(64, dim)
            pe[:, 0::2], pe[:, 1::2] = torch.sin(position * div), torch.cos(position * div)
            self.register_buffer("pe", pe)

        def forward(self, input_ids: Tensor) -> Tensor:
            x = self.wte(input_ids) + self.pe[: input_ids.shape[1]]
            for block in self.h:
                x = block(x)
            return self.lm_head(x)

    torch.manual_seed(0)
    model = Sinusoidal()
    batch = PackingCollate(max_tokens=MAX_TOKENS)(_samples())
    warns = pytest.warns(UserWarning, match="positions with no row axis")
    with warns as caught, packed_documents(batch), torch.no_grad():
        torch.stack([model(batch["input_ids"]) for _ in range(2)])  # two calls, one warning
    named = [str(w.message) for w in caught if "no row axis" in str(w.message)]
    assert named == [
        "A table of 12 positions with no row axis (shape (12, 32)) was added to the packed rows "
        "(3, 12, 32): absolute positions the model builds itself (a sinusoidal `pe[:T]`, a "
        "learned `pos_embed[:, :T]`) run on from one document into the next. Give the model's "
        "forward a `position_ids` argument and index its table with the batch's `position_ids` "
        "(`pe[position_ids]`), or do not pack."
    ]


@pytest.mark.parametrize("kind", list(MODELS))
def test_rotary_tables_are_not_named(kind: str, recwarn: pytest.WarningsRecorder) -> None:
    model = _model(kind)
    batch = PackingCollate(max_tokens=MAX_TOKENS)(_samples())
    with packed_documents(batch), torch.no_grad():
        model(batch["input_ids"])
    assert not [w for w in recwarn if "no row axis" in str(w.message)]


def test_a_forward_that_raises_leaves_no_mode_behind() -> None:
    class Failing(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            raise RuntimeError("boom")

    batch = PackingCollate(max_tokens=MAX_TOKENS)(_samples())
    depth = torch._C._len_torch_function_stack()
    with packed_documents(batch):
        with pytest.raises(RuntimeError, match="boom"):
            nn.Sequential(nn.Identity(), Failing())(torch.zeros(2))
        assert torch._C._len_torch_function_stack() == depth
    assert torch._C._len_torch_function_stack() == depth


class _Task(L.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[Tensor] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        losses = _token_losses(self.model, batch)
        self.losses.append(losses.detach().clone())
        return losses.sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("kind", list(MODELS))
def test_attention_swap_fit_keeps_the_models_own_sdpa_per_document(
    kind: str, recwarn: pytest.WarningsRecorder
) -> None:
    """Its attention is skipped (SDPA already), yet nothing mixes, and no warning says so."""
    torch.manual_seed(0)
    task = _Task(MODELS[kind]())
    loader = DataLoader(_samples(), batch_size=6, collate_fn=PackingCollate(MAX_TOKENS))
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[AttentionSwap(backend="sdpa", verbose=False)])  # fmt: skip
    trainer.fit(task, loader)
    alone = _one_by_one(task.model, _samples())
    assert (task.losses[0] - alone).abs().max().item() <= 1e-5
    assert not [w for w in recwarn if "packed batch" in str(w.message)]
    # the global hooks that kept the model's own calls apart are gone with the fit
    assert _own_calls._HOOKS == []
    global_hooks = [
        *_module._global_forward_pre_hooks.values(),
        *_module._global_forward_hooks.values(),
    ]
    assert _own_calls._enter_call not in global_hooks
    assert _own_calls._exit_call not in global_hooks


@pytest.mark.parametrize("kind", list(MODELS))
def test_checkpointed_blocks_recompute_the_models_own_sdpa_per_document(kind: str) -> None:
    """Backward after the block: the kit's checkpoint replays the documents, and the mode."""
    from lightning_speedkit.distributed import checkpoint_blocks

    model = _model(kind)
    assert len(checkpoint_blocks(model, "auto")) == 2
    samples = _samples()
    batch = PackingCollate(max_tokens=MAX_TOKENS)(samples)
    reference_grads = _grads(model, _one_by_one(model, samples).sum())
    with packed_documents(batch):
        loss = _token_losses(model, batch).sum()
    assert _max_diff(_grads(model, loss), reference_grads) <= 1e-5
