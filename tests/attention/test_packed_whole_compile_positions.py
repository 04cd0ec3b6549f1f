"""Models that build their own positions, compiled whole, on packed batches.

A nanoGPT-style decoder (``b, t = idx.shape``, ``wpe(torch.arange(t, device=idx.device))``)
and Hugging Face BERT called without ``position_ids`` (a ``(1, S)`` slice of its position
buffer) give each document the logits and gradients of that document run alone, compiled
as ``torch.compile(model)`` as eagerly.

With torch 2.13, dynamo gave up on the decoder's frame (a graph break in its loop over
blocks) and ran it eagerly, under the kit's torch-function mode; it then compiled the
mode's ``__torch_function__`` as a frame of its own, which served one attribute read's
value for another: ``idx.device`` came back as ``idx.shape`` (a TypeError from
``arange``), and the decoder whose positions were added 2.9 off, silently. BERT's
positions ran on across documents (0.29 off).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_speedkit import packed_documents, swap_attention
from lightning_speedkit.data import PackingCollate

transformers = pytest.importorskip("transformers")

VOCAB, DIM, HEADS = 50, 32, 4
LENGTHS, MAX_TOKENS = (5, 3, 7, 2, 4, 6), 12  # 3 rows of 12: [5 3] [7 2] [4 6]


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, HEADS, -1).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))  # type: ignore[no-any-return]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.attn = nn.LayerNorm(DIM), _Attention()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.attn(self.ln(x))  # type: ignore[no-any-return]


class NanoGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(32, DIM)
        self.h = nn.ModuleList(_Block() for _ in range(2))
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, idx: Tensor) -> Tensor:
        _b, t = idx.shape  # nanoGPT unpacks the shape: the read dynamo served wrongly
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(x)  # type: ignore[no-any-return]


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=2, num_attention_heads=HEADS,
        intermediate_size=64, max_position_embeddings=32, type_vocab_size=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def _nanogpt_logits(model: nn.Module, ids: Tensor) -> Tensor:
    return model(ids)  # type: ignore[no-any-return]


def _bert_logits(model: nn.Module, ids: Tensor) -> Tensor:
    return model(input_ids=ids).logits  # type: ignore[no-any-return]


def _documents() -> list[Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _per_document(logits: Tensor, batch: dict[str, Any]) -> list[Tensor]:
    """The packed rows' logits cut back into the documents, in their order."""
    ids, out = batch["document_ids"], []
    for row in range(ids.shape[0]):
        for document in ids[row].unique().tolist():
            if document >= 0:
                out.append(logits[row, ids[row] == document])
    return out


@pytest.mark.parametrize(
    ("make", "logits"), [(NanoGPT, _nanogpt_logits), (_bert, _bert_logits)], ids=["nanogpt", "bert"]
)
def test_a_model_compiled_whole_keeps_documents_and_restarts_its_own_positions(
    make: Callable[[], nn.Module], logits: Callable[[nn.Module, Tensor], Tensor]
) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make()
    swap_attention(model, "sdpa")
    documents = _documents()
    alone = [logits(model, d[None])[0] for d in documents]
    alone_grads = torch.autograd.grad(sum(a.square().sum() for a in alone), model.parameters())
    batch = PackingCollate(max_tokens=MAX_TOKENS)([{"input_ids": d} for d in documents])
    compiled = torch.compile(model, backend="eager")
    with packed_documents(batch):
        packed = _per_document(logits(compiled, batch["input_ids"]), batch)
        grads = torch.autograd.grad(sum(p.square().sum() for p in packed), model.parameters())
    assert [len(p) for p in packed] == list(LENGTHS)
    assert max((p - a).abs().max().item() for p, a in zip(packed, alone, strict=True)) <= 1e-5
    assert max((g - a).abs().max().item() for g, a in zip(grads, alone_grads, strict=True)) <= 1e-4
