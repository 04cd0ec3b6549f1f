"""SpeedMonitor on packed batches that nothing keeps apart: said once, never otherwise.

A packed batch in a fit with no attention swapped to take its documents trained with
every token attending across the documents of its row, and nothing said so.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap, SpeedMonitor, packed_documents, swap_attention
from lightning_speedkit.attention._own_calls import own_sdpa_modules
from lightning_speedkit.measure._packed_check import MIXED_DOCUMENTS

from ..attention.test_packed_documents import RunningMeanAttention
from .test_speed_monitor_tokens import TinyGPT, _packed

STEPS = 3


class Task(L.LightningModule):
    """TinyGPT (one nanoGPT attention layer) on ``input_ids``/``labels``; with
    ``packed=True`` each step runs inside ``packed_documents``, as the docs show for
    ``swap_attention`` without AttentionSwap."""

    def __init__(self, model: nn.Module | None = None, packed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = model if model is not None else TinyGPT()
        self.packed = packed

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        if not self.packed:
            return self._loss(batch)
        with packed_documents(batch):
            return self._loss(batch)

    def _loss(self, batch: dict[str, Any]) -> Tensor:
        logits = self.model(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(task: L.LightningModule, batch: Any, *callbacks: Any) -> list[str]:
    """Every warning of a fit of ``STEPS`` batches, each one as often as it was given."""
    trainer = L.Trainer(
        accelerator="cpu", max_steps=STEPS, logger=False, callbacks=list(callbacks),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(task, DataLoader([batch] * STEPS, batch_size=None))
    return [str(w.message) for w in caught]


def _said(task: L.LightningModule, batch: Any, *callbacks: Any) -> list[str]:
    """SpeedMonitor's warnings about mixed documents in a fit of ``STEPS`` batches."""
    return [m for m in _fit(task, batch, *callbacks) if m.startswith("SpeedMonitor: the")]


def _monitor() -> SpeedMonitor:
    return SpeedMonitor(peak_flops=None, warmup_steps=0)


def test_a_packed_fit_with_no_attention_swapped_is_said_once() -> None:
    assert _said(Task(), _packed(), _monitor()) == [MIXED_DOCUMENTS]
    assert MIXED_DOCUMENTS == (
        "SpeedMonitor: the training batches are packed (`cu_seqlens`/`document_ids`) but no "
        "attention was swapped to keep their documents apart, so every token attends across "
        "the documents of its row (the loss and the throughput are not those of the "
        "documents trained apart). Add `AttentionSwap()` to the Trainer's callbacks, or call "
        "`swap_attention(model)` and run each step inside `packed_documents(batch)`."
    )
    assert "\n" not in MIXED_DOCUMENTS  # one line


@pytest.mark.parametrize("field", ["seq_idx", "cu_seq_lens_q", "cu_seqlens", "document_ids"])
def test_each_packing_field_alone_marks_a_packed_batch(field: str) -> None:
    ours = _packed()
    ours_name = {"seq_idx": "document_ids", "cu_seq_lens_q": "cu_seqlens"}.get(field, field)
    batch = {"input_ids": ours["input_ids"], "labels": ours["labels"], field: ours[ours_name]}
    assert _said(Task(), batch, _monitor()) == [MIXED_DOCUMENTS]


class FlashLM(nn.Module):
    """A transformers-like model set to flash attention: it takes the flattening collator's
    keyword arguments (and here ignores them, as only the kernel would read them)."""

    def __init__(self, implementation: str) -> None:
        super().__init__()
        self.config = SimpleNamespace(_attn_implementation=implementation)  # transformers'
        self.inner = TinyGPT()

    def forward(self, input_ids: Tensor, **flash_kwargs: Any) -> Tensor:
        return self.inner(input_ids)


class PassesFields(Task):
    """``self.model(**batch)`` minus the labels, as a transformers user's step does."""

    def _loss(self, batch: dict[str, Any]) -> Tensor:
        logits = self.model(**{k: v for k, v in batch.items() if k != "labels"})
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


@pytest.mark.parametrize(
    ("implementation", "field", "step", "said"),
    [
        ("flash_attention_2", "cu_seq_lens_q", PassesFields, False),  # transformers' recipe
        ("flash_attention_3", "cu_seq_lens_q", PassesFields, False),
        ("flash_attention_2", "cu_seq_lens_q", Task, True),  # the step drops the field
        ("flash_attention_2", "cu_seqlens", PassesFields, True),  # ours: not read there
        ("sdpa", "cu_seq_lens_q", PassesFields, True),  # its sdpa path ignores the argument
    ],
)
def test_a_transformers_model_on_flash_attention_given_its_own_packing_fields(
    implementation: str, field: str, step: type[Task], said: bool
) -> None:
    """``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` and a model set to
    flash attention, called with them: transformers' variable-length kernel keeps the
    documents apart, and the warning (whose fix, AttentionSwap, would run them slower)
    was wrong there. Where the step does not hand the field to that model, it stands."""
    ours = _packed()
    batch = {"input_ids": ours["input_ids"], "labels": ours["labels"], field: ours["cu_seqlens"]}
    task = step(FlashLM(implementation))
    assert _said(task, batch, _monitor()) == ([MIXED_DOCUMENTS] if said else [])
    assert not task.model._forward_pre_hooks  # the watch's hooks are gone with its step


@pytest.mark.parametrize("monitor_first", [True, False], ids=["monitor-first", "swap-first"])
def test_attention_swap_in_the_callbacks_keeps_it_quiet_in_either_order(
    monitor_first: bool,
) -> None:
    swap = AttentionSwap("sdpa", measure=False, verbose=False)
    callbacks = [_monitor(), swap] if monitor_first else [swap, _monitor()]
    assert _said(Task(), _packed(), *callbacks) == []
    assert swap.report is not None
    assert swap.report.swapped == ["model.attn"]


def test_attention_swap_that_found_nothing_says_so_itself() -> None:
    """No module swapped, but AttentionSwap is there and names what mixes: its warning,
    not a second one telling the user to add it."""
    own_sdpa_modules()  # the process-wide record of SDPA calls kept apart: not earlier tests'
    model = nn.Sequential(nn.Embedding(50, 8), RunningMeanAttention(), nn.Linear(8, 50))
    swap = AttentionSwap("sdpa", measure=False, verbose=False)
    said = _fit(Task(model), _packed(), _monitor(), swap)
    assert not [m for m in said if m.startswith("SpeedMonitor: the")]
    assert len([m for m in said if "no attention was found" in m]) == 1


def test_swap_attention_on_the_model_keeps_it_quiet() -> None:
    task = Task(packed=True)
    assert swap_attention(task.model, "sdpa", measure=False).swapped == ["attn"]
    assert _said(task, _packed(), _monitor()) == []


def test_an_unpacked_batch_says_nothing() -> None:
    ids = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(0))
    assert _said(Task(), {"input_ids": ids, "labels": ids}, _monitor()) == []


def test_each_fit_checks_its_first_packed_batch_once() -> None:
    monitor, task = _monitor(), Task()
    assert _said(task, _packed(), monitor) == [MIXED_DOCUMENTS]
    assert _said(task, _packed(), monitor) == [MIXED_DOCUMENTS]  # a second fit, said again


class MLPTokens(nn.Module):
    """A token model with no attention: each position on its own, nothing to mix."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mlp = nn.Embedding(50, 8), nn.Sequential(nn.Linear(8, 16), nn.GELU())
        self.head = nn.Linear(16, 50)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.mlp(self.embed(ids)))


def test_a_packed_fit_of_a_model_without_attention_says_nothing() -> None:
    """The warning's fix, AttentionSwap, has nothing to swap there: it was a false alarm."""
    assert _said(Task(MLPTokens()), _packed(), _monitor()) == []


class WrittenOut(nn.Module):
    """Attention written out in a block named for nothing (a softmax in its forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return (q @ k.transpose(-2, -1)).softmax(-1) @ v


class InClosure(nn.Module):
    """SDPA called from a function defined inside the forward."""

    def forward(self, x: Tensor) -> Tensor:
        def attend(t: Tensor) -> Tensor:
            return F.scaled_dot_product_attention(t, t, t, is_causal=True)

        return attend(x)


class Mixer(nn.Module):
    pass


@pytest.mark.parametrize(
    ("model", "attends"),
    [
        (MLPTokens(), False),
        (nn.Sequential(nn.Conv1d(8, 8, 3), nn.GRU(8, 8)), False),
        (TinyGPT(), True),  # F.scaled_dot_product_attention in CausalSelfAttention.forward
        (nn.Sequential(WrittenOut()), True),
        (nn.Sequential(InClosure()), True),
        (nn.TransformerEncoderLayer(8, 2), True),
        (nn.Sequential(nn.MultiheadAttention(8, 2)), True),
        (nn.ModuleDict({"blocks": nn.ModuleList([type("LlamaAttention", (Mixer,), {})()])}), True),
    ],
    ids=["mlp", "conv-gru", "nanogpt", "written-out", "closure", "torch-layer", "mha", "named"],
)
def test_what_may_attend(model: nn.Module, attends: bool) -> None:
    from lightning_speedkit.measure._packed_check import may_attend

    assert may_attend(model) is attends
