"""A transformers key/value cache handed to a swapped model: each check run has its own.

Idefics3 (and SmolVLM, Idefics2, Mllama, Gemma 3) builds a ``DynamicCache`` in its outer
model and hands it to its language model, a sub-model swapped on its own. The parity
check once passed that object by reference to its own run, its fused run and its timing
runs, and the real call after them: each appended its keys and values to it. Without
gradients the fused run attended to the own run's keys too (reverted, "parity error
2.9e-01"); with them it reached back into the own run's freed graph, and a fit crashed
at its first step ("Trying to backward through the graph a second time").
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
from lightning_speedkit.attention._input_copies import caller, copy_inputs
from tests.helpers.hf_tiny import tiny_model
from tests.helpers.one_thread import one_intra_op_thread  # noqa: F401 (autouse)

transformers = pytest.importorskip("transformers")

_IMAGE = 63  # Idefics3's image token in a vocabulary of 64


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return tiny_model("LlamaConfig", "LlamaForCausalLM", vocab_size=64, hidden_size=32,
                      intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="eager")()  # fmt: skip


def _ids(n: int, seed: int = 0) -> Tensor:
    return torch.randint(0, 60, (2, n), generator=torch.Generator().manual_seed(seed))


def _reverts(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "AttentionSwap kept" in str(w.message)]


def _cache(model: nn.Module) -> Any:
    return transformers.DynamicCache(config=model.config)


def test_a_cache_passed_with_gradients_is_left_to_the_real_call() -> None:
    model = _llama()
    plain = copy.deepcopy(model)
    ids = _ids(10)
    report = swap_attention(model, "sdpa")  # measure: timing runs too, each on its own copy
    mine, theirs = _cache(model), _cache(plain)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model(ids, cache=mine, use_cache=True).logits
    assert not _reverts(caught)
    want = plain(ids, cache=theirs, use_cache=True).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert mine.get_seq_length() == theirs.get_seq_length() == 10  # appended to once
    grads = torch.autograd.grad(got.square().sum(), list(model.parameters()))
    wanted = torch.autograd.grad(want.square().sum(), list(plain.parameters()))
    assert max((g - w).abs().max().item() for g, w in zip(grads, wanted, strict=True)) <= 1e-5
    entry = report.modules[0]
    assert (entry.status, entry.checked) == ("active", "forward+backward")


def test_a_filled_cache_at_the_first_call_decodes_as_without_the_kit() -> None:
    model = _llama().eval()
    plain = copy.deepcopy(model)
    prompt, step = _ids(8), _ids(1, seed=1)
    with torch.no_grad():
        theirs = _cache(plain)
        plain(prompt, cache=theirs, use_cache=True)
        want = plain(step, cache=theirs, use_cache=True).logits
        mine = _cache(model)
        copy.deepcopy(plain)(prompt, cache=mine, use_cache=True)  # filled elsewhere
        report = swap_attention(model, "sdpa")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = model(step, cache=mine, use_cache=True).logits
    assert not _reverts(caught)
    assert report.modules[0].status == "active"
    assert mine.get_seq_length() == theirs.get_seq_length() == 9
    assert (got - want).abs().max().item() <= 1e-5


def test_copies_of_a_cache_holding_keys_with_gradients_are_detached_and_fresh_per_call() -> None:
    cache = transformers.DynamicCache()
    weight = torch.randn(4, 4, requires_grad=True)
    keys = torch.randn(1, 2, 3, 4) @ weight  # not a leaf: deepcopy refuses it
    cache.update(keys, keys * 2, layer_idx=0)
    (copied,), kwargs = copy_inputs((torch.randn(2, 3),), {"past_key_values": cache}, True)
    snapshot = kwargs["past_key_values"]
    assert snapshot is not cache
    assert snapshot.get_seq_length() == 3
    assert not snapshot.layers[0].keys.requires_grad
    assert torch.equal(snapshot.layers[0].keys, keys.detach())
    seen: list[Any] = []
    run = caller(lambda x, past_key_values: seen.append(past_key_values), ((copied,), kwargs))
    run()
    run()
    assert seen[0] is not seen[1]
    assert all(c is not snapshot and c is not cache for c in seen)
    seen[0].update(keys.detach(), keys.detach(), layer_idx=0)  # a run's own appends
    assert cache.get_seq_length() == snapshot.get_seq_length() == seen[1].get_seq_length() == 3


# --------------------------------------------------------------------- Idefics3 in a fit


def _idefics3() -> nn.Module:
    vision = transformers.Idefics3VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        image_size=32, patch_size=8,
    )  # fmt: skip
    text = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    config = transformers.Idefics3Config(
        vision_config=vision, text_config=text, image_token_id=_IMAGE, scale_factor=2
    )
    model = transformers.Idefics3ForConditionalGeneration(config)
    model.set_attn_implementation("eager")
    return model


def _batches() -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):  # 4 image tokens (16 patches, scale factor 2), then 8 of text
        text = torch.randint(0, 58, (3, 8), generator=g)
        ids = torch.cat([torch.full((3, 4), _IMAGE), text], dim=1)
        pixels = torch.randn(3, 1, 3, 32, 32, generator=g)
        batches.append({"input_ids": ids, "pixel_values": pixels,
                        "labels": ids.masked_fill(ids == _IMAGE, -100)})  # fmt: skip
    return batches


class _Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _idefics3()
        self.losses: list[Tensor] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss  # use_cache left on: the outer model builds a cache
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(callbacks: list[Any]) -> _Task:
    task = _Task()
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)  # fmt: skip
    trainer.fit(task, DataLoader(_batches(), batch_size=None))
    return task


def test_idefics3_fits_with_attention_swap_as_without_it() -> None:
    plain = _fit([])
    swap = AttentionSwap("sdpa", verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        swapped = _fit([swap])
    assert not _reverts(caught)
    text = next(m for m in swap.report.modules if m.name.endswith("text_model"))
    assert (text.status, text.checked) == ("active", "forward+backward")
    assert len(swapped.losses) == len(plain.losses) == 2
    for got, want in zip(swapped.losses, plain.losses, strict=True):
        assert abs(got.item() - want.item()) <= 1e-5
