"""Bidirectional encoders packed: BERT and hand-written non-causal encoders.

An encoder's attention is not causal, so a packed row left alone lets every token see
every document of its row, before and after it. With the documents handed to the swapped
attention (``packed_documents``, as AttentionSwap does every step), each token's outputs,
losses and gradients are those of its document run alone, whether the model is given the
batch's ``position_ids`` or builds its own ``(1, S)`` positions (BERT called without them:
restarted per document, on one row too).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap, packed_documents, swap_attention
from lightning_speedkit.attention._documents import active
from lightning_speedkit.data import PackingCollate

from .test_swap import TimmStyleAttention

transformers = pytest.importorskip("transformers")

VOCAB, LENGTHS, MAX_TOKENS = 50, (5, 3, 7, 2, 4, 6), 12  # 3 rows of 12: [5 3] [7 2] [4 6]
LAYOUTS = {"rows": MAX_TOKENS, "flattened": sum(LENGTHS)}


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, type_vocab_size=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config)


def _samples() -> list[dict[str, Tensor]]:
    """Tokenizer-like samples; every third label ignored, as a masked-LM collator leaves."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in LENGTHS:
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        labels = torch.where(torch.arange(n) % 3 == 1, -100, ids)
        samples.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids),
                        "token_type_ids": torch.randint(0, 2, (n,), generator=g)})  # fmt: skip
    return samples


def _bert_logits(model: nn.Module, fields: dict[str, Tensor]) -> Tensor:
    return model(**fields).logits  # type: ignore[no-any-return]


def _fields(batch: dict[str, Any], positions: str) -> dict[str, Tensor]:
    names = ["input_ids", "attention_mask", "token_type_ids"]
    return {f: batch[f] for f in names + (["position_ids"] if positions == "passed" else [])}


def _token_losses(logits: Tensor, labels: Tensor) -> Tensor:
    losses = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none")
    return losses[labels.flatten() != -100]


def _grads(model: nn.Module, loss: Tensor) -> dict[str, Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _one_by_one(
    model: nn.Module, samples: list[dict[str, Tensor]], logits: Callable[..., Tensor]
) -> tuple[Tensor, Tensor]:
    """Each sample's per-token logits and losses, the sample alone (no padding, no mask)."""
    outs = [logits(model, {f: s[f][None] for f in ("input_ids", "token_type_ids")}
                   )[0] for s in samples]  # fmt: skip
    losses = [_token_losses(o, s["labels"]) for o, s in zip(outs, samples, strict=True)]
    return torch.cat(outs), torch.cat(losses)


@pytest.mark.parametrize("positions", ["passed", "built"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bert_packed_gives_each_tokens_outputs_losses_and_gradients_of_one_by_one(
    layout: str, positions: str, recwarn: pytest.WarningsRecorder
) -> None:
    """BERT's masked-LM head on packed rows, with and without the batch's ``position_ids``
    (without: its ``(1, S)`` position buffer, restarted per document, one row included)."""
    model = _bert()
    swap_attention(model, "sdpa")
    samples = _samples()
    batch = PackingCollate(max_tokens=LAYOUTS[layout])(samples)
    assert batch["input_ids"].shape == ((3, 12) if layout == "rows" else (1, 27))
    alone, alone_losses = _one_by_one(model, samples, _bert_logits)
    alone_grads = _grads(model, alone_losses.sum())
    with packed_documents(batch):
        logits = _bert_logits(model, _fields(batch, positions))
        losses = _token_losses(logits, batch["labels"])
        grads = _grads(model, losses.sum())
    real = batch["document_ids"] >= 0
    assert (logits[real] - alone).abs().max().item() <= 1e-5
    assert losses.shape == alone_losses.shape == (sum(LENGTHS) - 9,)  # 9 labels ignored
    assert (losses - alone_losses).abs().max().item() <= 1e-5
    assert _max_diff(grads, alone_grads) <= 1e-5
    assert not [w for w in recwarn if "packed" in str(w.message)]


@pytest.mark.parametrize("positions", ["passed", "built"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bert_packed_without_the_kit_attends_across_documents(layout: str, positions: str) -> None:
    """The leak the kit removes: the same rows, no documents handed to attention."""
    model = _bert()
    samples = _samples()
    batch = PackingCollate(max_tokens=LAYOUTS[layout])(samples)
    alone, _ = _one_by_one(model, samples, _bert_logits)
    with torch.no_grad():
        leaked = _bert_logits(model, _fields(batch, positions))[batch["document_ids"] >= 0]
    assert (leaked - alone).abs().max().item() > 1e-3  # 100x the packed tolerance


class _MaskedLM(L.LightningModule):
    """The user's task: ``self.model(**batch).loss``, the packing fields included."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[Tensor] = []
        self.grads: dict[str, Tensor] = {}

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        assert active() is not None
        loss = self.model(**batch).loss
        self.losses.append(loss.detach().clone())
        return loss  # type: ignore[no-any-return]

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_bert_trained_packed_in_a_fit_gives_the_loss_of_one_by_one(
    recwarn: pytest.WarningsRecorder,
) -> None:
    model = _bert()
    reference = copy.deepcopy(model)
    samples = _samples()
    task = _MaskedLM(model)
    loader = DataLoader(samples, batch_size=len(samples), collate_fn=PackingCollate(MAX_TOKENS))
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[AttentionSwap(backend="sdpa", verbose=False)])  # fmt: skip
    trainer.fit(task, loader)
    _, alone_losses = _one_by_one(reference, samples, _bert_logits)
    assert abs(task.losses[0].item() - alone_losses.mean().item()) <= 1e-5
    alone_grads = _grads(reference, alone_losses.mean())
    assert _max_diff(task.grads, alone_grads) <= 1e-5
    assert not [w for w in recwarn if "packed batch" in str(w.message)]


# ------------------------------------------------------ hand-written non-causal encoders


class EncoderSelfAttention(nn.Module):
    """BERT's self-attention written out: separate projections, no mask (structural)."""

    def __init__(self, dim: int = 32, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.query, self.key, self.value = (nn.Linear(dim, dim) for _ in range(3))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.num_heads, -1).transpose(1, 2)
                   for p in (self.query, self.key, self.value))  # fmt: skip
        att = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(B, T, C))


class _MHA(nn.Module):
    """``nn.MultiheadAttention`` as an encoder calls it: self-attention, no weights."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(dim, 4, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.mha(x, x, x, need_weights=False)[0]  # type: ignore[no-any-return]


ATTENTIONS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "timm": (TimmStyleAttention, "timm"),
    "structural": (EncoderSelfAttention, "structural"),
    "mha": (_MHA, "multihead_attention"),
}


class Encoder(nn.Module):
    """A pre-norm encoder with learned absolute positions indexed by ``position_ids``."""

    def __init__(self, attention: Callable[[], nn.Module], dim: int = 32) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, dim), nn.Embedding(16, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(4))
        self.attns = nn.ModuleList(attention() for _ in range(2))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        x = self.tokens(input_ids) + self.positions(position_ids)
        for i, (attn, mlp) in enumerate(zip(self.attns, self.mlps, strict=True)):
            x = x + attn(self.norms[2 * i](x))
            x = x + mlp(self.norms[2 * i + 1](x))
        return self.head(x)  # type: ignore[no-any-return]


def _encoder_logits(model: nn.Module, fields: dict[str, Tensor]) -> Tensor:
    ids = fields["input_ids"]
    positions = fields.get("position_ids", torch.arange(ids.shape[-1]).expand_as(ids))
    return model(ids, positions)  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", list(ATTENTIONS))
def test_hand_written_encoders_packed_give_the_outputs_and_gradients_of_one_by_one(
    kind: str,
) -> None:
    attention, family = ATTENTIONS[kind]
    torch.manual_seed(0)
    model = Encoder(attention)
    reference = copy.deepcopy(model)
    report = swap_attention(model, "sdpa")
    inner = ".mha" if kind == "mha" else ""
    assert report.swapped == [f"attns.0{inner}", f"attns.1{inner}"]
    assert {m.family for m in report.modules} == {family}
    samples = _samples()
    batch = PackingCollate(max_tokens=MAX_TOKENS)(samples)
    alone, alone_losses = _one_by_one(model, samples, _encoder_logits)
    alone_grads = _grads(model, alone_losses.sum())
    with packed_documents(batch):
        logits = _encoder_logits(model, _fields(batch, "passed"))
        losses = _token_losses(logits, batch["labels"])
        grads = _grads(model, losses.sum())
    real = batch["document_ids"] >= 0
    assert (logits[real] - alone).abs().max().item() <= 1e-5
    assert (losses - alone_losses).abs().max().item() <= 1e-5
    assert _max_diff(grads, alone_grads) <= 1e-5
    with torch.no_grad():  # the leak, without the kit: every token sees its whole row
        leaked = _encoder_logits(reference, _fields(batch, "passed"))[real]
    assert (leaked - alone).abs().max().item() > 1e-2
