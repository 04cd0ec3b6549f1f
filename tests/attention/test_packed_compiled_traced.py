"""Packed batches through compiled blocks whose attention only tracing finds (written
inline in the block's forward): the compiled code traced the block's own forward, so on
packed batches its attention ran over whole rows (a loss gap of up to 1.4e-3), with a
warning. That call now leaves the graph and runs swapped, each document apart."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.utils import counters

from .test_packed_compiled import BATCHES, MAX_TOKENS, Decoder, _fit, _samples


class InlineBlock(nn.Module):
    """nanoGPT's block with its attention written inline: no attention submodule."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.ln_1, self.qkv, self.proj = (
            nn.LayerNorm(dim),
            nn.Linear(dim, 3 * dim),
            nn.Linear(dim, dim),
        )
        self.ln_2, self.mlp = nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, dim), nn.GELU())
        self.heads = heads
        self.register_buffer("tril", torch.tril(torch.ones(MAX_TOKENS, MAX_TOKENS)))

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(self.ln_1(x)).split(C, 2)
        )
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        weights = scores.masked_fill(self.tril[:T, :T] == 0, float("-inf")).softmax(-1)
        x = x + self.proj((weights @ v).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln_2(x))


def _decoder() -> nn.Module:
    return Decoder(block=InlineBlock)


def test_inline_attention_in_compiled_blocks_keeps_packed_documents_apart(
    recwarn: pytest.WarningsRecorder,
) -> None:
    torch._dynamo.reset()
    counters.clear()
    compiled = _fit(compiled=True, make=_decoder, backend="aot_eager")  # AttentionSwap too
    eager = _fit(compiled=False, make=_decoder)
    for c, e in zip(compiled.losses, eager.losses, strict=True):
        assert (c - e).abs().max().item() <= 1e-5
    model = _decoder()
    model.load_state_dict(compiled.initial)
    alone = torch.cat([F.cross_entropy(model(s["input_ids"][None])[0], s["labels"],
                                       reduction="none") for s in _samples()[:6]])  # fmt: skip
    assert (compiled.losses[0] - alone).abs().max().item() <= 1e-5
    assert compiled.graphs == [compiled.graphs[0]] * len(BATCHES)  # new layouts: no new graph
    assert not [w for w in recwarn if "own attention" in str(w.message)]
