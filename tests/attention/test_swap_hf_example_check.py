"""A Hugging Face model's check on the kit's small example input does not revert it.

PaliGemma hands its Gemma language model (``use_bidirectional_attention=True``) a prefix
mask of its own. Called alone on the swap's example (random ``input_ids``, no mask),
that Gemma masks causally in eager and not at all in SDPA, 0.04 apart in transformers
itself: the example check reverted it (parity error 0.12) and the whole fit kept eager,
though on PaliGemma's real calls the two agree. A transformers model's real masking
comes from the call, so its first real call decides; a model whose swap is wrong on its
real calls is still reverted there.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import Tensor, nn

from lightning_speedkit import swap_attention
from tests.helpers.one_thread import one_intra_op_thread  # noqa: F401 (autouse)

transformers = pytest.importorskip("transformers")

IMAGE = 63  # PaliGemma's image token in a vocabulary of 64; 16 of them per image


def _paligemma() -> nn.Module:
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        image_size=32, patch_size=8, projection_dim=32,
    )  # fmt: skip
    text = transformers.GemmaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    config = transformers.PaliGemmaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE, projection_dim=32
    )
    config.text_config.vocab_size = 64
    torch.manual_seed(0)
    model = transformers.PaliGemmaForConditionalGeneration(config)
    model.set_attn_implementation("eager")
    return model


def _batch() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    text = torch.randint(0, 58, (2, 8), generator=g)
    ids = torch.cat([torch.full((2, 16), IMAGE), text], dim=1)
    token_types = torch.zeros_like(ids)
    token_types[:, -3:] = 1  # the suffix, causal; the image and prompt attend both ways
    labels = ids.masked_fill(ids == IMAGE, -100)
    pixels = torch.randn(2, 3, 32, 32, generator=g)
    return {
        "input_ids": ids,
        "pixel_values": pixels,
        "token_type_ids": token_types,
        "labels": labels,
    }


def _kept(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "AttentionSwap kept" in str(w.message)]


def test_paligemma_language_model_is_swapped_and_matches_its_own_attention() -> None:
    model = _paligemma()
    plain = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = swap_attention(model, "sdpa")
        language = next(m for m in report.modules if m.name.endswith("language_model"))
        assert language.status == "pending"  # its example differed: its first call decides
        batch = _batch()
        got = model(**batch)
        grads = torch.autograd.grad(got.loss, list(model.parameters()), allow_unused=True)
    assert not _kept(caught)
    assert (language.status, language.checked) == ("active", "forward+backward")
    want = plain(**batch)
    wanted = torch.autograd.grad(want.loss, list(plain.parameters()), allow_unused=True)
    assert (got.logits - want.logits).abs().max().item() <= 1e-5
    pairs = [(g, w) for g, w in zip(grads, wanted, strict=True) if w is not None]
    assert max((g - w).abs().max().item() for g, w in pairs) <= 1e-5


def test_a_model_whose_swap_is_wrong_on_its_real_calls_is_still_reverted() -> None:
    config = transformers.GemmaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, vocab_size=64, use_bidirectional_attention=True,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GemmaModel(config)  # alone: eager causal, SDPA bidirectional
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = swap_attention(model, "sdpa")
        assert report.modules[0].status == "pending"
        got = model(ids).last_hidden_state
    (entry,) = report.modules
    assert entry.status == "reverted"
    assert (entry.parity_error or 0.0) > 1e-2
    assert "on forward+backward inputs" in entry.reason
    assert len(_kept(caught)) == 1
    assert torch.equal(got, plain(ids).last_hidden_state)  # its own attention ran
