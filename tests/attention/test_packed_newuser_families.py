"""More Hugging Face families trained packed, as a user writes it: ``model(**batch)``.

Tiny configs, built from the config (nothing downloaded). Each family's per-token logits
on packed rows equal those of each document run alone, and its loss and gradients too;
a family whose attention the swap cannot take (no SDPA attention in transformers) is
said, once, never silently mixed. On CUDA, transformers' flash and flex paths would
unpad by the attention mask and mix a row's documents: a packed batch runs its SDPA path.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap, _imports, swap_attention
from lightning_speedkit.attention import _documents as documents_module
from lightning_speedkit.attention import adapters, packed_documents
from lightning_speedkit.attention.backends import Attend
from lightning_speedkit.data import PackingCollate
from tests.helpers.hf_tiny import tiny_model

transformers = pytest.importorskip("transformers")

VOCAB, LENGTHS = 50, (5, 3, 7, 2, 4, 6)
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               use_cache=False)  # fmt: skip


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "qwen2": tiny_model("Qwen2Config", "Qwen2ForCausalLM", **DECODER),
    "qwen3": tiny_model("Qwen3Config", "Qwen3ForCausalLM", head_dim=8, **DECODER),
    "gemma3-sliding-window": tiny_model(
        "Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8, sliding_window=4, **DECODER
    ),
    "phi": tiny_model("PhiConfig", "PhiForCausalLM", **DECODER),
    "gpt-neox": tiny_model(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        use_cache=False,
    ),
    "opt": tiny_model(
        "OPTConfig",
        "OPTForCausalLM",
        vocab_size=VOCAB,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        use_cache=False,
    ),
    "falcon": tiny_model(
        "FalconConfig",
        "FalconForCausalLM",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        use_cache=False,
    ),
    "gpt-bigcode-mqa": tiny_model(
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        multi_query=True,
        use_cache=False,
    ),
    "mixtral-moe": tiny_model(
        "MixtralConfig", "MixtralForCausalLM", num_local_experts=2, num_experts_per_tok=1, **DECODER
    ),
}
#: Families whose attention has no SDPA path in transformers: the swap skips them.
UNSWAPPABLE: dict[str, Callable[[], nn.Module]] = {
    "gemma2": tiny_model(
        "Gemma2Config", "Gemma2ForCausalLM", head_dim=8, sliding_window=4, **DECODER
    ),
    "bloom": tiny_model(
        "BloomConfig",
        "BloomForCausalLM",
        vocab_size=VOCAB,
        hidden_size=32,
        n_layer=2,
        n_head=4,
        use_cache=False,
    ),
}


def _documents() -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]


def _batch(layout: str) -> dict[str, Any]:
    docs = _documents()
    if layout == "rows":  # three padded rows, the tokenizer's attention_mask packed too
        samples = [
            {"input_ids": d, "labels": d, "attention_mask": torch.ones_like(d)} for d in docs
        ]
        return PackingCollate(max_tokens=12, separate_documents=True)(samples)
    samples = [{"input_ids": d, "labels": d} for d in docs]  # one row, no attention_mask
    return PackingCollate(max_tokens=sum(LENGTHS), separate_documents=True)(samples)


def _spans(batch: dict[str, Any]) -> list[tuple[int, int, int]]:
    """Each document's (row, start, end), in document order."""
    ids = batch["document_ids"]
    return [
        (int(r), int(cols[0]), int(cols[-1]) + 1)
        for doc in range(len(LENGTHS))
        for r, cols in [((ids == doc).nonzero()[0, 0], (ids == doc).nonzero()[:, 1])]
    ]


def _one_by_one(model: nn.Module) -> tuple[list[Tensor], Tensor]:
    """Each document's logits alone, and the packed loss they make: a mean over targets."""
    outs = [model(input_ids=d[None], labels=d[None]) for d in _documents()]
    targets = torch.tensor([n - 1 for n in LENGTHS], dtype=torch.float32)
    loss = (torch.stack([o.loss for o in outs]) * targets).sum() / targets.sum()
    return [o.logits[0] for o in outs], loss


def _max_grad_diff(a: nn.Module, b: nn.Module) -> float:
    pairs = [(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True)]
    return max((x - y).abs().max().item() for x, y in pairs if y is not None)


@pytest.mark.parametrize("layout", ["rows", "flattened"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_packed_gives_the_logits_loss_and_gradients_of_one_by_one(
    family: str, layout: str, recwarn: pytest.WarningsRecorder
) -> None:
    torch.manual_seed(0)
    model = FAMILIES[family]()
    reference = copy.deepcopy(model)
    report = swap_attention(model, "sdpa")
    swap_attention(reference, "sdpa")
    assert report.swapped
    batch = _batch(layout)
    with packed_documents(batch):
        out = model(**batch)  # PackingCollate's extra fields go in too
        out.loss.backward()
    alone, expected = _one_by_one(reference)
    expected.backward()
    for (r, s, e), logits in zip(_spans(batch), alone, strict=True):
        assert (out.logits[r, s:e] - logits).abs().max().item() <= 1e-5
    assert (out.loss - expected).abs().item() <= 1e-5
    assert _max_grad_diff(model, reference) <= 1e-5
    assert not [w for w in recwarn if "packed batch" in str(w.message)]


@pytest.mark.parametrize("family", list(UNSWAPPABLE))
def test_a_family_the_swap_skips_is_said_once_not_silently_mixed(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(documents_module, "_WARNED", set())  # said once per process: afresh here
    torch.manual_seed(0)
    model = UNSWAPPABLE[family]()
    report = swap_attention(model, "sdpa")
    assert not report.swapped
    assert "has no SDPA attention in transformers" in report.skipped[0][1]
    batch = _batch("rows")

    def twice() -> Tensor:
        for _ in range(2):
            with packed_documents(batch), torch.no_grad():
                logits = model(**batch).logits
        return logits

    said = r"reached attention in '\w+Attention' that the kit did not swap: a softmax"
    with pytest.warns(UserWarning, match=said) as caught:
        packed = twice()
    assert len([w for w in caught if "did not swap: a softmax" in str(w.message)]) == 1
    alone, _ = _one_by_one(model)
    mixed = max((packed[r, s:e] - a).abs().max().item() for (r, s, e), a in
                zip(_spans(batch), alone, strict=True))  # fmt: skip
    assert mixed > 1e-4  # what the warning is about: the documents did mix


class _Task(L.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[Tensor] = []
        self.grads: list[dict[str, Tensor]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.losses.append(loss.detach().clone())
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grads.append({n: p.grad.clone() for n, p in self.model.named_parameters()})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.parametrize("family", ["qwen3", "gpt-neox", "opt"])
def test_family_in_a_fit_on_packed_rows_gives_the_loss_of_one_by_one(family: str) -> None:
    torch.manual_seed(0)
    model = FAMILIES[family]()
    reference = copy.deepcopy(model)
    docs = _documents()
    samples = [{"input_ids": d, "labels": d, "attention_mask": torch.ones_like(d)} for d in docs]
    collate = PackingCollate(max_tokens=12, separate_documents=True)
    task = _Task(model)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[AttentionSwap(backend="sdpa", verbose=False)])  # fmt: skip
    trainer.fit(task, DataLoader(samples, batch_size=len(samples), collate_fn=collate))
    swap_attention(reference, "sdpa")
    _, expected = _one_by_one(reference)
    expected.backward()
    assert (task.losses[0] - expected).abs().item() <= 1e-5
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert max((task.grads[0][n] - g).abs().max().item() for n, g in grads.items()) <= 1e-5


@pytest.mark.parametrize(
    ("backend", "own"), [("flash", "flash_attention_2"), ("flex", "flex_attention")]
)
def test_on_cuda_a_packed_batch_runs_transformers_sdpa_path_not_flash_or_flex(
    backend: str, own: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' flash path unpads by the attention mask (a row's documents mixed) and
    reads packing off ``position_ids`` only for a batch of one row; its flex path builds
    its mask likewise. Packed, the model runs SDPA, which the kit cuts per document.
    (Dispatch only: flash-attn cannot be installed here.)"""
    model = FAMILIES["qwen2"]()
    monkeypatch.setattr(adapters, "device_of", lambda module: torch.device("cuda"))
    monkeypatch.setattr(_imports, "FLASH_ATTN_AVAILABLE", True)
    ctx = adapters.SwapContext(model, model.forward, Attend(backend), model.config)
    assert adapters._hf_implementation(ctx) == own
    with packed_documents(_batch("rows")):
        assert adapters._hf_implementation(ctx) == "sdpa"
    assert adapters._hf_implementation(ctx) == own
