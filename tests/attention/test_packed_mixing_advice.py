"""AttentionSwap's warning about attention that mixes a packed batch's documents gives the
fix for each case: ``register_adapter`` for a family the kit does not know, never for a
transformers family transformers runs without SDPA (Gemma 2, GPT-Neo, BLOOM), where the
fix is transformers' own mask, or not packing at all."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_speedkit import swap_attention
from lightning_speedkit.attention._documents import StepDocuments
from lightning_speedkit.attention._mixing_advice import mixing_message
from tests.helpers.hf_tiny import tiny_model

from .test_packed_newuser_families import UNSWAPPABLE, _batch, _one_by_one, _spans

transformers = pytest.importorskip("transformers")

FAMILIES: dict[str, Callable[[], nn.Module]] = {
    **UNSWAPPABLE,
    "gpt-neo": tiny_model(
        "GPTNeoConfig", "GPTNeoForCausalLM", vocab_size=50, hidden_size=32, num_layers=2,
        num_heads=4, attention_types=[[["global", "local"], 1]], window_size=4,
        max_position_embeddings=64, use_cache=False, bos_token_id=1, eos_token_id=2,
    ),
}  # fmt: skip
HEAD = (
    "A packed batch (`cu_seqlens`/`document_ids`) reached attention that AttentionSwap did "
    "not swap, which attends across the documents of a row: "
)
SWAP_IT = (
    "wap it (`register_adapter` for a family the kit does not know; `tolerance=` for a module "
    "that failed its check), or write the document mask into that module, or do not pack."
)


def _apart(classes: str) -> str:
    return (
        f"transformers runs {classes} without SDPA, so the kit cannot swap it "
        "(`register_adapter` would not help); transformers' own mask keeps the documents "
        "apart where it reads them off `position_ids` (recent versions): pack without "
        "`attention_mask`, pass the batch's `position_ids` and `use_cache=False` (this check "
        "cannot see that mask), or do not pack."
    )


NEVER = (
    "transformers runs BloomForCausalLM, BloomModel without SDPA and takes no `position_ids` "
    "(its positions run over the whole row), so neither the kit nor transformers can keep "
    "packed documents apart there: do not pack it (pad; `LengthBucketBatchSampler` keeps the "
    "padding small)."
)
EXPECTED = {
    "gemma2": f"{HEAD}'(root)', 'model'. {_apart('Gemma2ForCausalLM, Gemma2Model')}",
    "gpt-neo": f"{HEAD}'(root)', 'transformer'. {_apart('GPTNeoForCausalLM, GPTNeoModel')}",
    "bloom": f"{HEAD}'(root)', 'transformer'. {NEVER}",
}


def _said(model: nn.Module) -> list[str]:
    """AttentionSwap's warnings about mixed documents after one packed step of ``model``."""
    report = swap_attention(model, "sdpa")
    step = StepDocuments()
    step.enter(_batch("rows"))
    with pytest.warns(UserWarning, match="reached attention") as caught:
        step.exit(report, model)
    return [str(w.message) for w in caught if "reached attention" in str(w.message)]


@pytest.mark.parametrize("family", list(EXPECTED))
def test_a_family_transformers_runs_without_sdpa_gets_its_own_fix(family: str) -> None:
    torch.manual_seed(0)
    assert _said(FAMILIES[family]()) == [EXPECTED[family]]


def test_a_family_the_kit_does_not_know_still_gets_register_adapter() -> None:
    assert mixing_message(["h.1.attn", "vision"], {}) == f"{HEAD}'h.1.attn', 'vision'. S{SWAP_IT}"
    assert mixing_message([], {}) == f"{HEAD}no attention was found. S{SWAP_IT}"


def test_each_module_gets_the_fix_of_its_case() -> None:
    torch.manual_seed(0)
    bloom = FAMILIES["bloom"]()
    modules = {"lm": bloom, "lm.transformer": bloom.transformer, "head.attn": nn.Linear(2, 2)}
    assert mixing_message(["lm", "head.attn", "lm.transformer"], modules) == (
        f"{HEAD}'lm', 'head.attn', 'lm.transformer'. For 'head.attn': s{SWAP_IT} {NEVER}"
    )


def _mixed(model: nn.Module, batch: dict[str, Any]) -> float:
    """The largest difference between a packed batch's logits and each document's alone."""
    fields = {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask") if k in batch}
    with torch.no_grad():
        logits: Tensor = model(**fields, use_cache=False).logits
        alone, _ = _one_by_one(model)
    return max(
        (logits[r, s:e] - a).abs().max().item()
        for (r, s, e), a in zip(_spans(batch), alone, strict=True)
    )


@pytest.mark.parametrize("family", list(EXPECTED))
def test_the_fix_each_family_is_given_is_the_true_one(family: str) -> None:
    """Packed without ``attention_mask``, with ``position_ids`` and no cache, Gemma 2 and
    GPT-Neo keep the documents apart in transformers' own mask; BLOOM mixes them still."""
    masking = pytest.importorskip("transformers.masking_utils")
    if not hasattr(masking, "find_packed_sequence_indices"):
        pytest.skip("this transformers does not read documents off `position_ids`")
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    batch = _batch("rows")
    assert _mixed(model, batch) > 1e-3  # the tokenizer's attention_mask packed: mixed
    del batch["attention_mask"]
    if family == "bloom":
        assert _mixed(model, batch) > 1e-3  # nothing keeps them apart
    else:
        assert _mixed(model, batch) <= 1e-5  # each document as it runs alone
