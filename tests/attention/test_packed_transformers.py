"""Hugging Face causal LMs trained on packed batches as users write it: ``model(**batch)``.

transformers' own packed path (``DataCollatorWithFlattening``) flattens a batch into one
row whose ``position_ids`` restart per document and whose documents' first labels are
-100. ``PackingCollate`` gives the same fields (and more rows when asked); either batch,
passed whole to the model inside a Trainer fit with AttentionSwap, gives each document's
loss and the gradients of the documents run one by one.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap, swap_attention
from lightning_speedkit.attention._documents import active
from lightning_speedkit.data import PackingCollate

transformers = pytest.importorskip("transformers")

VOCAB, LENGTHS = 50, (5, 3, 7, 2, 4, 6)


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _documents() -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _flattening() -> Any:
    return transformers.DataCollatorWithFlattening(
        return_tensors="pt", return_flash_attn_kwargs=True, return_seq_idx=True
    )


def test_packing_collate_gives_the_fields_of_transformers_flattening() -> None:
    docs = _documents()
    ours = PackingCollate(max_tokens=sum(LENGTHS), separate_documents=True)(
        [{"input_ids": d, "labels": d} for d in docs]
    )
    theirs = _flattening()([{"input_ids": d.tolist()} for d in docs])
    for field in ("input_ids", "labels", "position_ids"):
        assert ours[field].tolist() == theirs[field].tolist(), field
    assert ours["document_ids"].tolist() == theirs["seq_idx"].tolist()
    assert ours["cu_seqlens"].tolist() == theirs["cu_seq_lens_q"].tolist()


class _Task(L.LightningModule):
    """The user's LightningModule: the batch's fields go to the model as they are."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[Tensor] = []
        self.spans: list[Any] = []
        self.grads: list[dict[str, Tensor]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        documents = active()  # transformers' field names are read too
        self.spans.append(None if documents is None else documents.spans)
        loss = self.model(**batch).loss
        self.losses.append(loss.detach().clone())
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grads.append({n: p.grad.clone() for n, p in self.model.named_parameters()})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _collate(layout: str) -> Any:
    if layout == "rows":  # three rows of 12, padded, the tokenizer's attention_mask kept
        return PackingCollate(max_tokens=12, separate_documents=True)
    if layout == "flattened":  # one row, no attention_mask: transformers' convention
        return PackingCollate(max_tokens=sum(LENGTHS), separate_documents=True)

    def hf(samples: list[dict[str, Tensor]]) -> dict[str, Any]:
        return dict(_flattening()([{"input_ids": s["input_ids"].tolist()} for s in samples]))

    return hf


@pytest.mark.parametrize("layout", ["rows", "flattened", "transformers_collator"])
@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_a_fit_on_packed_batches_gives_the_losses_of_one_by_one(make: Any, layout: str) -> None:
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    docs = _documents()
    samples = [{"input_ids": d, "labels": d} for d in docs]
    if layout == "rows":
        samples = [{**s, "attention_mask": torch.ones_like(s["input_ids"])} for s in samples]
    task = _Task(model)
    loader = DataLoader(samples, batch_size=len(samples), collate_fn=_collate(layout))
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[AttentionSwap(backend="sdpa", verbose=False)])  # fmt: skip
    trainer.fit(task, loader)
    swap_attention(reference, "sdpa")
    alone = torch.stack([reference(input_ids=d[None], labels=d[None]).loss for d in docs])
    targets = torch.tensor([len(d) - 1 for d in docs], dtype=torch.float32)
    expected = (alone * targets).sum() / targets.sum()  # the packed loss: a mean over tokens
    reference.zero_grad()
    expected.backward()
    assert task.spans[0] is not None
    if layout != "rows":  # one row, its documents as the collator cut them
        bounds = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
        assert task.spans[0] == (tuple(itertools.pairwise(bounds)),)
    assert (task.losses[0] - expected).abs().item() <= 1e-5
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert max((task.grads[0][n] - g).abs().max().item() for n, g in grads.items()) <= 1e-5


def test_a_cut_call_is_not_cut_again_by_the_models_own_sdpa_mode(
    recwarn: pytest.WarningsRecorder,
) -> None:
    """A swapped call's per-document pieces pass the enclosing mode as they are."""
    from lightning_speedkit.attention import packed_documents

    torch.manual_seed(0)
    model = _gpt2()
    swap_attention(model, "sdpa")
    docs = _documents()
    samples = [{"input_ids": d, "labels": d, "attention_mask": torch.ones_like(d)} for d in docs]
    batch = PackingCollate(max_tokens=sum(LENGTHS), separate_documents=True)(samples)
    with packed_documents(batch), torch.no_grad():
        model(**batch)
    assert not [w for w in recwarn if "attends across documents" in str(w.message)]
