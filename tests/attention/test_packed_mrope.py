"""Qwen2-VL packed with its images: multimodal rotary positions (M-RoPE).

Qwen2-VL places an image's tokens by time, height and width; the batch's 2-D
``position_ids`` (``PackingCollate``'s, restarting per document) give them the positions
of a line of text instead. The docs once told every user to pass them: each caption
token's loss came out 6.1e-4 off its document alone, with nothing said. Now a warning
says to leave them out for such a model, and left out, each document's losses are its
own (the model's positions run on over the row, but rotary attention cut per document
sees only the distances within each).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_speedkit import packed_documents, swap_attention
from lightning_speedkit.attention import _documents
from lightning_speedkit.attention._multimodal_positions import multimodal_rope
from lightning_speedkit.data import PackingCollate
from tests.attention.test_packed_llava import _token_losses, document_losses
from tests.helpers.one_thread import one_intra_op_thread  # noqa: F401 (autouse)

transformers = pytest.importorskip("transformers")

IMAGE, START, END = 63, 61, 60  # image, vision start, vision end tokens in a vocabulary of 64
CAPTIONS = (5, 9, 3, 7)
FIELDS = ("labels", "attention_mask", "mm_token_type_ids")


def _qwen2_vl() -> nn.Module:
    vision = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=8,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)  # fmt: skip
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64, max_position_embeddings=256,
                rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})  # fmt: skip
    config = transformers.Qwen2VLConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE, video_token_id=62,
        vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2VLForConditionalGeneration(config).eval()


def _samples() -> list[dict[str, Tensor]]:
    """An image of 4x4 patches (4 tokens after the 2x2 merge) and its caption each."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in CAPTIONS:
        caption = torch.randint(1, 58, (n,), generator=g)
        image = torch.tensor([START, IMAGE, IMAGE, IMAGE, IMAGE, END])
        ids = torch.cat([image, caption])
        samples.append({"input_ids": ids, "labels": ids.masked_fill(ids == IMAGE, -100),
                        "pixel_values": torch.randn(16, 384, generator=g),
                        "image_grid_thw": torch.tensor([1, 4, 4]),
                        "mm_token_type_ids": (ids == IMAGE).long()})  # fmt: skip
    return samples


def _alone(model: Any, samples: list[dict[str, Tensor]]) -> Tensor:
    return torch.cat([
        _token_losses(model(input_ids=s["input_ids"][None], pixel_values=s["pixel_values"],
                            image_grid_thw=s["image_grid_thw"][None],
                            mm_token_type_ids=s["mm_token_type_ids"][None]).logits,
                      s["labels"][None])
        for s in samples
    ])  # fmt: skip


def _packed(model: Any, batch: dict[str, Any], positions: bool) -> Tensor:
    """The packed rows' per-token losses in document order (arrival order: no first fit)."""
    call = {"input_ids": batch["input_ids"], "pixel_values": batch["pixel_values"].flatten(0, 1),
            "image_grid_thw": batch["image_grid_thw"],
            "mm_token_type_ids": batch["mm_token_type_ids"]}  # fmt: skip
    if positions:
        call["position_ids"] = batch["position_ids"]
    with packed_documents(batch):
        logits = model(**call).logits
    return document_losses(logits, batch)


def _said(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "M-RoPE" in str(w.message)]


def test_qwen2_vl_packed_with_images_warns_about_position_ids_and_is_exact_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_documents, "_WARNED", set())  # said once per process: afresh here
    model = _qwen2_vl()
    swap_attention(model, "sdpa")
    samples = _samples()
    batch = PackingCollate(32, separate_documents=True, token_fields=FIELDS)(samples)
    assert batch["input_ids"].shape[0] < len(samples)  # documents share rows
    with torch.no_grad():
        alone = _alone(model, samples)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            given = _packed(model, batch, positions=True)
            _packed(model, batch, positions=True)
        with warnings.catch_warnings(record=True) as left_out:
            warnings.simplefilter("always")
            built = _packed(model, batch, positions=False)
    said = _said(caught)
    assert len(said) == 1  # once, for the outer model (its language model gets them next)
    assert "2-D `position_ids` reached Qwen2VLForConditionalGeneration" in said[0]
    assert "Qwen2-VL" in said[0]
    assert "Leave `position_ids` out for this model" in said[0]
    assert (given - alone).abs().max().item() > 1e-5  # what the warning is about
    assert not _said(left_out)
    assert built.shape == alone.shape
    assert (built - alone).abs().max().item() <= 1e-5  # the fix it gives


def test_rotary_positions_of_one_axis_are_not_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_documents, "_WARNED", set())
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    swap_attention(model, "sdpa")
    docs = [torch.randint(0, 64, (n,)) for n in (5, 3, 7)]
    batch = PackingCollate(16)([{"input_ids": d} for d in docs])
    with warnings.catch_warnings(record=True) as caught, packed_documents(batch), torch.no_grad():
        warnings.simplefilter("always")
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    assert not _said(caught)
    gemma3 = transformers.Gemma3TextConfig()  # rope parameters per layer type, no M-RoPE
    assert not multimodal_rope(gemma3)
    assert not multimodal_rope(config)
    assert multimodal_rope(_qwen2_vl().config)
