"""Packed batches: swapped attention keeps documents apart, exactly as one by one."""

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

from lightning_speedkit import ActivationCheckpointing, AttentionSwap, swap_attention
from lightning_speedkit.attention import packed_documents
from lightning_speedkit.attention._documents import active
from lightning_speedkit.data import PackingCollate
from lightning_speedkit.distributed import checkpoint_blocks
from lightning_speedkit.errors import SpeedkitConfigError

VOCAB, LENGTHS, MAX_TOKENS = 50, (5, 3, 7, 2, 4, 6), 12


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, its mask a lower-triangular buffer."""

    def __init__(self, dim: int = 32, n_head: int = 4, block_size: int = 16) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        mask = torch.tril(torch.ones(block_size, block_size))
        self.register_buffer("bias", mask.view(1, 1, block_size, block_size))

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), CausalSelfAttention(dim)
        self.ln_2, self.mlp = nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, dim), nn.GELU())

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT-style, its learned positions taken from ``position_ids`` (see docs)."""

    def __init__(self, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, dim), nn.Embedding(16, dim)
        self.h = nn.ModuleList(Block(dim) for _ in range(layers))
        self.lm_head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        x = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.h:
            x = block(x)
        return self.lm_head(x)


class MHADecoder(nn.Module):
    """``nn.TransformerEncoderLayer`` blocks with a causal mask: the multihead_attention family."""

    def __init__(self, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, dim), nn.Embedding(16, dim)
        self.h = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.lm_head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        x = self.wte(input_ids) + self.wpe(position_ids)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for block in self.h:
            x = block(x, src_mask=mask, is_causal=True)
        return self.lm_head(x)


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "nanogpt": NanoGPT, "mha": MHADecoder, "gpt2": _gpt2, "llama": _llama,
}  # fmt: skip


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[kind]()
    swap_attention(model, "sdpa")
    return model


def _samples(seed: int = 0) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(0, VOCAB, (n,), generator=g),
         "labels": torch.randint(0, VOCAB, (n,), generator=g),
         "attention_mask": torch.ones(n, dtype=torch.long)}  # as a tokenizer gives it
        for n in LENGTHS
    ]  # fmt: skip


def _logits(model: nn.Module, ids: Tensor, positions: Tensor, mask: Tensor | None) -> Tensor:
    if isinstance(model, (NanoGPT, MHADecoder)):
        return model(ids, positions)
    # Hugging Face: with an attention mask (a tokenizer's), transformers builds no document
    # mask from the positions; without one it does (a dense S x S mask of its own).
    return model(input_ids=ids, position_ids=positions, attention_mask=mask).logits


def _token_losses(model: nn.Module, batch: dict[str, Any]) -> Tensor:
    """Per-token losses of the real tokens, in document order (labels not shifted)."""
    logits = _logits(model, batch["input_ids"], batch["position_ids"], batch.get("attention_mask"))
    losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    return losses[batch["labels"].flatten() != -100]


def _one_by_one(model: nn.Module, samples: list[dict[str, Tensor]]) -> Tensor:
    losses = []
    for sample in samples:
        ids, labels = sample["input_ids"][None], sample["labels"][None]
        mask = torch.ones_like(ids) if "attention_mask" in sample else None
        logits = _logits(model, ids, torch.arange(ids.shape[1])[None], mask)
        losses.append(F.cross_entropy(logits[0], labels[0], reduction="none"))
    return torch.cat(losses)


def _grads(model: nn.Module, loss: Tensor) -> dict[str, Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("kind", list(MODELS))
def test_packed_losses_and_gradients_equal_one_by_one(kind: str) -> None:
    model = _model(kind)
    samples = _samples()
    batch = PackingCollate(max_tokens=MAX_TOKENS)(samples)
    assert batch["input_ids"].shape == (3, MAX_TOKENS)  # several documents per row
    reference = _one_by_one(model, samples)
    reference_grads = _grads(model, reference.sum())
    with packed_documents(batch):
        packed = _token_losses(model, batch)
        packed_grads = _grads(model, packed.sum())
    assert packed.shape == reference.shape == (sum(LENGTHS),)
    assert (packed - reference).abs().max().item() <= 1e-5
    assert _max_diff(packed_grads, reference_grads) <= 1e-5


@pytest.mark.parametrize("kind", list(MODELS))
def test_without_the_documents_packed_rows_leak(kind: str) -> None:
    """What packing did before: every token attended across the documents of its row."""
    model = _model(kind)
    samples = _samples()
    batch = PackingCollate(max_tokens=MAX_TOKENS)(samples)
    leak = (_token_losses(model, batch) - _one_by_one(model, samples)).abs().max().item()
    assert leak > 1e-3


def test_hugging_face_flattened_row_with_cu_seqlens_only() -> None:
    """transformers' DataCollatorWithFlattening layout: one row, ``position_ids``, no mask."""
    model = _model("llama")
    samples = [{k: v for k, v in s.items() if k != "attention_mask"} for s in _samples()]
    total = sum(LENGTHS)
    batch = PackingCollate(max_tokens=total)(samples)
    del batch["document_ids"]
    assert batch["input_ids"].shape == (1, total)
    assert batch["cu_seqlens"][-1] == total
    with packed_documents(batch):
        packed = _token_losses(model, batch)
    assert (packed - _one_by_one(model, samples)).abs().max().item() <= 1e-5


def test_checkpointed_blocks_recompute_under_the_same_documents() -> None:
    """Backward after the block (as a user may write it): the checkpoint replays them."""
    model = _model("nanogpt")
    assert checkpoint_blocks(model, "auto") == ["h.0", "h.1"]
    samples = _samples()
    batch = PackingCollate(max_tokens=MAX_TOKENS)(samples)
    reference_grads = _grads(model, _one_by_one(model, samples).sum())
    with packed_documents(batch):
        loss = _token_losses(model, batch).sum()
    assert active() is None
    assert _max_diff(_grads(model, loss), reference_grads) <= 1e-5


def test_equal_length_documents_share_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("nanogpt")
    samples = [{"input_ids": torch.arange(n) % VOCAB} for n in (4, 4, 3, 4)]
    batch = PackingCollate(max_tokens=8)(samples)  # rows [4, 4] and [3, 4, pad 1]
    shapes: list[tuple[int, ...]] = []
    real = F.scaled_dot_product_attention

    def recording(q: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        shapes.append(tuple(q.shape))
        return real(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    with packed_documents(batch), torch.no_grad():
        model(batch["input_ids"], batch["position_ids"])  # the first call is checked too
        shapes.clear()
        model(batch["input_ids"], batch["position_ids"])
    # Per layer: the three 4-token documents in one call, then the 3 tokens, the padding.
    assert shapes == [(3, 4, 4, 8), (1, 4, 3, 8), (1, 4, 1, 8)] * 2


def test_a_batch_without_packing_fields_changes_nothing() -> None:
    with packed_documents({"input_ids": torch.zeros(2, 4, dtype=torch.long)}) as documents:
        assert documents is None
        assert active() is None


def test_cu_seqlens_alone_splits_whole_rows() -> None:
    """Hugging Face's flattening convention: one row, no padding, cu_seqlens only."""
    batch = {"input_ids": torch.zeros(1, 9, dtype=torch.long),
             "cu_seqlens": torch.tensor([0, 4, 6, 9], dtype=torch.int32)}  # fmt: skip
    with packed_documents(batch) as documents:
        assert documents is not None
        assert documents.spans == (((0, 4), (4, 6), (6, 9)),)


def test_cu_seqlens_that_disagree_with_document_ids_are_refused() -> None:
    batch = PackingCollate(max_tokens=8)([{"input_ids": torch.arange(3)},
                                          {"input_ids": torch.arange(4)}])  # fmt: skip
    batch["cu_seqlens"] = torch.tensor([0, 4, 7], dtype=torch.int32)
    disagree = (
        r"`cu_seqlens` and `document_ids` disagree: documents of \[4, 3\] tokens in "
        r"`cu_seqlens`, \[3, 4\] in `document_ids`; build both with the same PackingCollate"
    )
    with pytest.raises(SpeedkitConfigError, match=disagree), packed_documents(batch):
        pass


def test_cu_seqlens_that_do_not_end_at_the_rows_are_refused() -> None:
    batch = {"input_ids": torch.zeros(1, 9, dtype=torch.long),
             "cu_seqlens": torch.tensor([0, 4, 7], dtype=torch.int32)}  # fmt: skip
    ends = (r"`cu_seqlens` must end at the 1 x 9 = 9 tokens of the batch's rows, got "
            r"\[0, 4, 7\] \(ending at 7\); with padding")  # fmt: skip
    with pytest.raises(SpeedkitConfigError, match=ends), packed_documents(batch):
        pass


# ------------------------------------------------------------------ AttentionSwap


class _Task(L.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.seen: list[bool] = []
        self.losses: list[Tensor] = []
        self.grads: list[dict[str, Tensor]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        self.seen.append(active() is not None)
        losses = _token_losses(self.model, batch)
        self.losses.append(losses.detach().clone())
        return losses.sum()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grads.append({n: p.grad.clone() for n, p in self.model.named_parameters()})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_attention_swap_keeps_documents_apart_with_accumulation_and_checkpointing() -> None:
    torch.manual_seed(0)
    model = NanoGPT()
    reference_model = copy.deepcopy(model)
    samples = _samples(0) + _samples(1)
    task = _Task(model)
    loader = DataLoader(samples, batch_size=len(LENGTHS), collate_fn=PackingCollate(MAX_TOKENS))
    trainer = L.Trainer(
        max_steps=1, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[AttentionSwap(backend="sdpa", measure=False, verbose=False),
                   ActivationCheckpointing(blocks="auto")],
    )  # fmt: skip
    trainer.fit(task, loader)
    assert task.seen == [True, True]
    assert active() is None
    swap_attention(reference_model, "sdpa")
    reference = [_one_by_one(reference_model, samples[:6]),
                 _one_by_one(reference_model, samples[6:])]  # fmt: skip
    for packed, alone in zip(task.losses, reference, strict=True):
        assert (packed - alone).abs().max().item() <= 1e-5
    # Lightning scales each micro-batch's loss by 1 / accumulate_grad_batches.
    reference_grads = _grads(reference_model, sum(r.sum() for r in reference) / 2)
    assert _max_diff(task.grads[0], reference_grads) <= 1e-5


def test_documents_are_cleared_when_the_step_raises() -> None:
    class Failing(_Task):
        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
            raise RuntimeError("boom")

    loader = DataLoader(_samples(), batch_size=6, collate_fn=PackingCollate(MAX_TOKENS))
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[AttentionSwap(backend="sdpa", verbose=False)])  # fmt: skip
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Failing(NanoGPT()), loader)
    assert active() is None


# ------------------------------------------------------- attention the kit did not swap


def test_a_packed_step_names_the_attention_that_mixes_documents_once() -> None:
    from lightning_speedkit.attention import SwapReport
    from lightning_speedkit.attention._documents import StepDocuments
    from lightning_speedkit.attention._swap_report import ModuleSwap

    report = SwapReport("sdpa", modules=[
        ModuleSwap("h.0.attn", "structural", "sdpa", status="active"),
        ModuleSwap("h.1.attn", "structural", "sdpa", status="reverted", reason="parity"),
    ], skipped=[("vision", "no SDPA attention in transformers")])  # fmt: skip
    batch = PackingCollate(max_tokens=8)([{"input_ids": torch.arange(3)}])
    step = StepDocuments()
    states = []

    def two_steps() -> None:
        for _ in range(2):
            step.enter(batch)
            states.append(active() is not None)
            step.exit(report)
            states.append(active() is not None)

    with pytest.warns(UserWarning, match="packed batch") as caught:
        two_steps()
    assert states == [True, False, True, False]
    assert [str(w.message) for w in caught] == [
        "A packed batch (`cu_seqlens`/`document_ids`) reached attention that AttentionSwap did "
        "not swap, which attends across the documents of a row: 'h.1.attn', 'vision'. Swap it "
        "(`register_adapter` for a family the kit does not know; `tolerance=` for a module that "
        "failed its check), or write the document mask into that module, or do not pack."
    ]


def test_every_attention_swapped_or_no_packing_warns_nothing(
    recwarn: pytest.WarningsRecorder,
) -> None:
    from lightning_speedkit.attention import SwapReport
    from lightning_speedkit.attention._documents import StepDocuments
    from lightning_speedkit.attention._swap_report import ModuleSwap

    swapped = SwapReport("sdpa", modules=[ModuleSwap("a", "structural", "sdpa", status="active")])
    unswapped = SwapReport("sdpa", skipped=[("b", "no SDPA")])
    step = StepDocuments()
    step.enter(PackingCollate(max_tokens=8)([{"input_ids": torch.arange(3)}]))
    step.exit(swapped)
    step.enter({"input_ids": torch.zeros(1, 4)})  # not packed
    step.exit(unswapped)
    assert not [w for w in recwarn if "packed batch" in str(w.message)]


class RunningMeanAttention(nn.Module):
    """Attention of its own that the kit cannot find (no softmax): a running mean over the
    row's tokens, which mixes its documents."""

    def forward(self, x: Tensor) -> Tensor:
        return x.cumsum(1) / torch.arange(1, x.shape[1] + 1)[:, None]


def test_attention_swap_on_a_model_whose_attention_it_cannot_find_warns_once_per_fit() -> None:
    class Plain(_Task):
        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
            return self.model(batch["input_ids"]).sum()

    task = Plain(nn.Sequential(nn.Embedding(VOCAB, 8), RunningMeanAttention(), nn.Linear(8, 4)))
    loader = DataLoader(_samples() * 2, batch_size=6, collate_fn=PackingCollate(MAX_TOKENS))
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[AttentionSwap(backend="sdpa", verbose=False)])  # fmt: skip
    with pytest.warns(UserWarning, match="packed batch") as caught:
        trainer.fit(task, loader)
    packed = [str(w.message) for w in caught if "packed batch" in str(w.message)]
    assert len(packed) == 1
    assert "attends across the documents of a row: no attention was found." in packed[0]


# ------------------------------------------------------------------ the traced family


class InlineCausal(nn.Module):
    """Attention only a trace finds (no name the kit knows); heads kept apart or folded."""

    def __init__(self, dim: int = 32, heads: int = 4, fold: bool = False) -> None:
        super().__init__()
        self.heads, self.fold = heads, fold
        self.w_in, self.w_out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.register_buffer("keep", torch.ones(16, 16).tril().bool())

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.w_in(x).split(c, dim=2)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        if self.fold:  # (b * heads, n, d), as diffusers' old attention
            q, k, v = (t.reshape(b * self.heads, n, -1) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / (c // self.heads) ** 0.5
        weights = scores.masked_fill(~self.keep[:n, :n], float("-inf")).softmax(dim=-1)
        out = (weights @ v).reshape(b, self.heads, n, -1).transpose(1, 2).reshape(b, n, c)
        return self.w_out(out)


class TracedDecoder(NanoGPT):
    """The nanoGPT-style decoder with inline attention in place of its own."""

    def __init__(self, fold: bool = False) -> None:
        super().__init__()
        for block in self.h:
            assert isinstance(block, Block)
            block.attn = InlineCausal(fold=fold)  # type: ignore[assignment]


def _traced(fold: bool) -> nn.Module:
    torch.manual_seed(0)
    model = TracedDecoder(fold)
    ids = torch.randint(0, VOCAB, (2, 6))
    report = swap_attention(model, "sdpa", sample=(ids, torch.arange(6).expand(2, 6)))
    assert [m.family for m in report.modules] == ["traced", "traced"]
    return model


def test_traced_attention_keeps_packed_documents_apart() -> None:
    model = _traced(fold=False)
    samples = _samples()
    batch = PackingCollate(max_tokens=MAX_TOKENS)(samples)
    reference = _one_by_one(model, samples)
    reference_grads = _grads(model, reference.sum())
    with packed_documents(batch):
        packed = _token_losses(model, batch)
        packed_grads = _grads(model, packed.sum())
    assert (packed - reference).abs().max().item() <= 1e-5
    assert _max_diff(packed_grads, reference_grads) <= 1e-5


def test_heads_folded_into_the_batch_are_named_not_guessed() -> None:
    model = _traced(fold=True)
    batch = PackingCollate(max_tokens=MAX_TOKENS)(_samples())
    folding = "batch of 12, not the batch's 3 rows"
    with pytest.warns(UserWarning, match=folding) as caught, packed_documents(batch):
        _token_losses(model, batch)
    folded = [w for w in caught if "heads folded" in str(w.message)]
    assert len(folded) == 1


def test_packed_validation_batches_keep_documents_apart() -> None:
    class Validated(_Task):
        def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
            self.seen.append(active() is not None)
            self.losses.append(_token_losses(self.model, batch))

    torch.manual_seed(0)
    task = Validated(NanoGPT())
    loader = DataLoader(_samples(), batch_size=6, collate_fn=PackingCollate(MAX_TOKENS))
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[AttentionSwap(backend="sdpa", verbose=False)])  # fmt: skip
    trainer.validate(task, loader)
    assert task.seen == [True]
    assert active() is None
    alone = _one_by_one(task.model, _samples())
    assert (task.losses[0] - alone).abs().max().item() <= 1e-5


# --------------------------------------------------- positions the model builds itself


class OwnPositions(NanoGPT):
    """nanoGPT exactly: ``self.wpe(torch.arange(t))``, no ``position_ids`` taken."""

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(x)


@pytest.mark.parametrize("kind", ["nanogpt", "gpt2"])
def test_positions_a_model_builds_itself_restart_per_document(kind: str) -> None:
    """nanoGPT's ``arange`` and GPT-2 without ``position_ids``: restarted, exactly."""
    torch.manual_seed(0)
    model = OwnPositions() if kind == "nanogpt" else _gpt2()
    swap_attention(model, "sdpa")
    samples = [{k: v for k, v in s.items() if k != "attention_mask"} for s in _samples()]
    batch = PackingCollate(max_tokens=MAX_TOKENS)(samples)

    def logits(ids: Tensor) -> Tensor:
        return model(ids) if kind == "nanogpt" else model(input_ids=ids).logits

    labels = batch["labels"].flatten()
    reference = torch.cat([F.cross_entropy(logits(s["input_ids"][None])[0], s["labels"],
                                           reduction="none") for s in samples])  # fmt: skip
    reference_grads = _grads(model, reference.sum())
    with packed_documents(batch):
        losses = F.cross_entropy(logits(batch["input_ids"]).flatten(0, 1), labels, reduction="none")
        packed = losses[labels != -100]
        packed_grads = _grads(model, packed.sum())
    assert (packed - reference).abs().max().item() <= 1e-5
    assert _max_diff(packed_grads, reference_grads) <= 1e-5
    with torch.no_grad():  # outside the documents, the model's own positions again
        assert logits(batch["input_ids"]).shape == (3, MAX_TOKENS, VOCAB)


def test_an_embedding_fed_anything_but_the_row_positions_is_left_alone() -> None:
    batch = PackingCollate(max_tokens=4)([{"input_ids": torch.arange(2)}] * 4)  # 2 rows of 4
    embedding = nn.Embedding(8, 1)
    with torch.no_grad():
        embedding.weight.copy_(torch.arange(8.0)[:, None])
    with packed_documents(batch), torch.no_grad():
        restarted = embedding(torch.arange(4))[..., 0]
        others = [embedding(ids)[..., 0] for ids in (torch.tensor([3, 2, 1, 0]), torch.arange(3))]
    assert restarted.tolist() == [[0, 1, 0, 1], [0, 1, 0, 1]]
    assert [o.tolist() for o in others] == [[3, 2, 1, 0], [0, 1, 2]]


def test_a_causal_call_longer_than_the_packed_rows_is_named() -> None:
    """The example VLM's decoder: image tokens before the packed text, one row longer."""
    from speedkit_examples.vlm import VLM, VLMConfig

    torch.manual_seed(0)
    model = VLM(VLMConfig.preset("tiny", vocab_size=VOCAB))
    swap_attention(model, "sdpa")
    batch = PackingCollate(max_tokens=MAX_TOKENS)(_samples())
    images = torch.randn(3, 3, 32, 32)
    longer = "causal attention call over the batch's 3 rows has"
    with pytest.warns(UserWarning, match=longer), packed_documents(batch), torch.no_grad():
        model(images, batch["input_ids"])


def test_packed_bf16_losses_within_the_swaps_bf16_tolerance() -> None:
    model = _model("nanogpt")
    samples = _samples()
    batch = PackingCollate(max_tokens=MAX_TOKENS)(samples)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        reference = _one_by_one(model, samples)
        with packed_documents(batch):
            packed = _token_losses(model, batch)
    assert (packed - reference).abs().max().item() <= 3e-2 * reference.abs().max().item()
