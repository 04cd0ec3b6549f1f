"""``trainer.fit(torch.compile(task))`` on packed batches: warned only where documents mix.

Lightning compiles ``training_step``, so the model's first module call is traced and the
mode that cuts the model's own SDPA calls per document cannot open. The swapped
attention still keeps documents apart (its cut is a graph break that runs eagerly), so a
model whose every attention is swapped is not warned about (a false alarm a new user
met, with losses equal to each document's alone); one with a module that calls SDPA
itself, which the swap leaves as it is, is warned about, naming that module.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap, swap_attention
from lightning_speedkit.attention import _own_calls
from lightning_speedkit.attention._documents import StepDocuments
from lightning_speedkit.data import PackingCollate

from .test_packed_compiled import Decoder
from .test_packed_documents import LENGTHS, MAX_TOKENS, NanoGPT, _one_by_one, _samples, _Task

COMPILED = "torch.compile traced from outside"
#: What the warning says of the decoder whose rotary attention calls SDPA itself.
NAMED = (
    "A packed batch ran through a model that torch.compile traced from outside any module "
    "call (`trainer.fit(torch.compile(task))`, a compiled `training_step`): the SDPA calls "
    "that 'model.h.0.rope_attn', 'model.h.1.rope_attn' make themselves (the swap does not "
    "replace them) attend across the documents of a row there. Compile the model instead "
    "(`self.model = torch.compile(self.model)`) or its blocks (`RegionalCompile`)."
)


class _DecoderTask(_Task):
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        return self.model(batch["input_ids"]).float().mean()


def _fit_compiled(task: L.LightningModule) -> None:
    torch._dynamo.reset()
    # two batches of the same documents
    loader = DataLoader(
        _samples() * 2, batch_size=len(LENGTHS), collate_fn=PackingCollate(MAX_TOKENS)
    )
    swap = AttentionSwap(backend="sdpa", measure=False, verbose=False)
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[swap])  # fmt: skip
    trainer.fit(torch.compile(task, backend="eager"), loader)


def test_a_compiled_step_whose_attention_is_all_swapped_is_exact_and_not_warned(
    recwarn: pytest.WarningsRecorder,
) -> None:
    torch.manual_seed(0)
    model = NanoGPT()  # nanoGPT's written-out attention: swapped, no SDPA call of its own
    reference = copy.deepcopy(model)
    task = _Task(model)
    _fit_compiled(task)
    assert not [w for w in recwarn if COMPILED in str(w.message)]
    swap_attention(reference, "sdpa")
    alone = _one_by_one(reference, _samples())
    for packed in task.losses:  # lr 0: both steps are each document's alone
        assert (packed - alone).abs().max().item() <= 1e-5


def test_a_compiled_step_with_attention_calling_sdpa_itself_names_it_once() -> None:
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=COMPILED) as record:
        _fit_compiled(_DecoderTask(Decoder()))
    assert [str(w.message) for w in record if COMPILED in str(w.message)] == [NAMED]


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Decoder()


def test_the_modules_named_are_those_whose_own_sdpa_calls_the_swap_leaves() -> None:
    model = _Model()
    unswapped = ["model.h.0.rope_attn", "model.h.1.rope_attn"]
    assert _own_calls.own_sdpa_outside_swap(None, model) == unswapped
    report = swap_attention(model, "sdpa")
    assert report.swapped == ["model.h.0.attn", "model.h.1.attn"]
    assert _own_calls.own_sdpa_outside_swap(report, model) == unswapped
    # A module the swap replaces is not named, nor one inside it.
    report.modules[0].name = "model.h.0"
    assert _own_calls.own_sdpa_outside_swap(report, model) == ["model.h.1.rope_attn"]


@pytest.mark.parametrize("own_sdpa", [False, True])
def test_a_step_seen_compiled_outside_warns_only_with_own_sdpa_calls(own_sdpa: bool) -> None:
    """StepDocuments without a compile: the flag a traced module call sets, set by hand."""
    model: nn.Module = _Model() if own_sdpa else NanoGPT()
    report = swap_attention(model, "sdpa")
    step = StepDocuments()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):  # said once
            step.enter(PackingCollate(MAX_TOKENS)(_samples()))
            _own_calls._COMPILED_OUTSIDE[0] = True
            step.exit(report, model)
    said = [str(w.message) for w in record if COMPILED in str(w.message)]
    assert said == ([NAMED] if own_sdpa else [])
    assert not _own_calls.compiled_outside_modules()  # read and cleared at each step
