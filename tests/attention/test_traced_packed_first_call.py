"""A packed batch as the first call of attention only tracing finds: its documents kept apart.

Attention written inline in a block (no attention submodule) is found by tracing the
first call that reaches it. On a packed batch that call is traced ahead of itself (on
copies, without gradients), so the call itself runs swapped, each document apart: the
first step's losses are each document's alone, where the call traced as it ran attended
across the documents of its rows (a gap of 1e-3 on the probe's model).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap, swap_attention
from lightning_speedkit.attention import _discovery, _documents, packed_documents
from lightning_speedkit.data import PackingCollate

VOCAB, DIM, MAX_TOKENS = 50, 32, 16
LENGTHS = (5, 3, 7, 2, 4, 6, 8, 3, 5, 4, 6, 2)


class InlineBlock(nn.Module):
    """Attention written out in the block's forward, causal by a ``tril`` buffer."""

    def __init__(self, heads: int = 4, block_size: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.o = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.nh, self.p = heads, dropout
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, 2)
        q, k, v = (t.view(B, T, self.nh, -1).transpose(1, 2) for t in (q, k, v))
        a = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        a = a.masked_fill(self.tril[:T, :T] == 0, float("-inf")).softmax(-1)
        a = F.dropout(a, self.p, self.training)
        x = x + self.o((a @ v).transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class InlineGPT(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(32, DIM)
        self.h = nn.ModuleList(InlineBlock() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        x = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.h:
            x = block(x)
        return self.head(x)


def _samples() -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g),
             "labels": torch.randint(0, VOCAB, (n,), generator=g)} for n in LENGTHS]  # fmt: skip


def _token_losses(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Per-token losses of the real tokens, in document order."""
    logits = model(batch["input_ids"], batch["position_ids"])
    losses = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    return losses[batch["labels"].flatten() != -100]


def _one_by_one(model: nn.Module, samples: list[dict[str, Tensor]]) -> Tensor:
    with torch.no_grad():
        return torch.cat([
            F.cross_entropy(model(s["input_ids"][None], torch.arange(len(s["input_ids"]))[None])[0],
                            s["labels"], reduction="none")
            for s in samples
        ])  # fmt: skip


class _Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = InlineGPT()
        self.losses: list[Tensor] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        losses = _token_losses(self.model, batch)
        self.losses.append(losses.detach().clone())
        return losses.mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _packed_warnings(caught: Any) -> list[str]:
    return [str(w.message) for w in caught if "packed batch" in str(w.message)]


@pytest.mark.parametrize("rotate", [0, 4])
def test_the_first_packed_training_step_keeps_documents_apart(
    rotate: int, recwarn: pytest.WarningsRecorder
) -> None:
    samples = _samples()
    samples = samples[rotate:] + samples[:rotate]
    torch.manual_seed(0)
    task = _Task()
    loader = DataLoader(samples, batch_size=6, collate_fn=PackingCollate(max_tokens=MAX_TOKENS))
    swap = AttentionSwap(backend="sdpa", verbose=False)
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[swap])  # fmt: skip
    trainer.fit(task, loader)
    assert swap.report is not None
    assert [(m.name, m.family, m.status) for m in swap.report.modules] == [
        (f"model.h.{i}", "traced", "active") for i in range(2)
    ]
    alone = _one_by_one(task.model, samples)
    packed = torch.cat(task.losses)
    assert packed.shape == alone.shape
    first = len(task.losses[0])
    assert (packed[:first] - alone[:first]).abs().max().item() <= 1e-5  # the first step
    assert (packed - alone).abs().max().item() <= 1e-5
    assert _packed_warnings(recwarn) == []


def test_without_a_trainer_the_first_packed_call_is_per_document_and_says_nothing(
    recwarn: pytest.WarningsRecorder,
) -> None:
    torch.manual_seed(0)
    model = InlineGPT()
    reference = _one_by_one(model, _samples())
    batch = PackingCollate(max_tokens=MAX_TOKENS)(_samples())
    with torch.no_grad():
        mixed = _token_losses(model, batch)
    assert (mixed - reference).abs().max().item() > 1e-3  # its rows hold several documents
    swap_attention(model, "sdpa")
    with packed_documents(batch):  # warns when attention ran over whole rows
        packed = _token_losses(model, batch)
    assert (packed - reference).abs().max().item() <= 1e-5
    assert _packed_warnings(recwarn) == []


def test_the_first_packed_call_draws_as_if_swapped_before_it() -> None:
    """Attention dropout on: the call draws the numbers the swapped attention would have."""
    torch.manual_seed(0)
    found_first = InlineGPT()
    for block in found_first.h:
        block.p = 0.2
    found_at_call = copy.deepcopy(found_first)
    batch = PackingCollate(max_tokens=MAX_TOKENS)(_samples())
    sample = (batch["input_ids"][:, :8], batch["position_ids"][:, :8])
    swap_attention(found_first, "sdpa", sample=sample)
    swap_attention(found_at_call, "sdpa")
    runs = []
    for model in (found_first, found_at_call):
        torch.manual_seed(1)
        with packed_documents(batch):
            losses = _token_losses(model, batch)
        runs.append((losses, torch.rand(3)))
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])  # the random state after it too


class _NormedGPT(InlineGPT):
    """A batch norm over the embeddings: running statistics updated in training calls."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(DIM)

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        x = self.wte(input_ids) + self.wpe(position_ids)
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        for block in self.h:
            x = block(x)
        return self.head(x)


def test_running_statistics_are_updated_once_by_the_first_packed_call(
    recwarn: pytest.WarningsRecorder,
) -> None:
    torch.manual_seed(0)
    found_first = _NormedGPT()
    found_at_call = copy.deepcopy(found_first)
    batch = PackingCollate(max_tokens=MAX_TOKENS)(_samples())
    swap_attention(found_first, "sdpa", sample=(batch["input_ids"], batch["position_ids"]))
    swap_attention(found_at_call, "sdpa")
    for model in (found_first, found_at_call):
        with packed_documents(batch):
            _token_losses(model, batch)
    assert found_at_call.norm.num_batches_tracked.item() == 1
    for name, buffer in found_first.norm.named_buffers():
        assert torch.equal(buffer, getattr(found_at_call.norm, name)), name
    assert [str(w.message) for w in recwarn if "changed twice" in str(w.message)] == []


class _Attention(nn.Module):
    """Attention alone, heads in ``self.h``: the structural family does not claim it."""

    def __init__(self) -> None:
        super().__init__()
        self.h, self.to_qkv, self.to_out = 4, nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.register_buffer("mask", torch.tril(torch.ones(32, 32)).bool())

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = self.to_qkv(x).view(B, N, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)
        w = q @ k.transpose(-1, -2) * (C // self.h) ** -0.5
        w = w.masked_fill(~self.mask[:N, :N], float("-inf")).softmax(-1)
        return self.to_out((w @ v).transpose(1, 2).reshape(B, N, C))


def test_a_module_first_called_on_its_own_is_swapped_for_that_very_call() -> None:
    """``nn.Module.__call__`` took the module's own forward before its pre-hook swapped
    it: that call's output is the swap's, each document apart."""
    torch.manual_seed(0)
    attention = _Attention()
    batch = PackingCollate(max_tokens=MAX_TOKENS)(_samples()[:4])
    x = torch.randn(*batch["input_ids"].shape, DIM)
    report = swap_attention(attention, "sdpa")
    with packed_documents(batch):
        packed = attention(x)
    assert [(m.family, m.status) for m in report.modules] == [("traced", "active")]
    assert attention._forward_hooks == {}  # the hook that replaced the output is gone
    for row, spans in enumerate(_spans(batch)):
        for start, end in spans:
            with torch.no_grad():
                alone = attention(x[row : row + 1, start:end])[0]
            assert (packed[row, start:end] - alone).abs().max().item() <= 1e-5


def _spans(batch: dict[str, Tensor]) -> list[list[tuple[int, int]]]:
    with packed_documents(batch) as documents:
        assert documents is not None
        return [list(spans) for spans in documents.spans]


class _NeedsGradients(InlineGPT):
    """A forward that refuses to run without gradients: the run ahead raises."""

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        if not torch.is_grad_enabled():
            raise RuntimeError("this model trains only")
        return super().forward(input_ids, position_ids)


@pytest.mark.parametrize("why", ["fsdp2", "raises"])
def test_a_call_that_cannot_be_traced_ahead_is_named_with_the_fix(
    why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under FSDP2 the call gathers its own parameters, and a forward may refuse the run
    ahead: the call is traced as it runs, and said."""
    if why == "fsdp2":
        monkeypatch.setattr(_discovery, "fsdp2_units", lambda module: [module])
    monkeypatch.setattr(_documents, "_WARNED", set())  # said once per process: afresh here
    torch.manual_seed(0)
    model = InlineGPT() if why == "fsdp2" else _NeedsGradients()
    swap_attention(model, "sdpa")
    batch = PackingCollate(max_tokens=MAX_TOKENS)(_samples())
    depth = torch._C._len_torch_function_stack()
    warns = pytest.warns(UserWarning, match="could not be traced ahead")
    with warns as caught, packed_documents(batch):
        _token_losses(model, batch)
    assert torch._C._len_torch_function_stack() == depth
    said = [m for m in _packed_warnings(caught) if "traced ahead" in m]
    assert said == [
        "Tracing found attention in 'h.0', 'h.1' on its first call, a packed batch's, which "
        "could not be traced ahead of itself: that call ran the module's own attention over "
        "whole rows, across the documents of a row (later calls keep them apart). Call "
        "`swap_attention(model, sample=...)` on an unpacked sample before fit, or make the "
        "first batch unpacked."
    ]
