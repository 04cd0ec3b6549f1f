"""FrozenFeatureCache on a Hugging Face VLM from a tiny config (Llava: CLIP vision + Llama)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit.compute.frozen_feature_cache import FrozenFeatureCache
from tests.helpers.one_thread import one_intra_op_thread  # noqa: F401 (autouse)

transformers = pytest.importorskip("transformers")


_IMAGE_TOKEN, _PATCHES = 63, 16  # a 32 x 32 image in 8 x 8 patches


def _llava() -> Any:
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    text = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=64,
        max_position_embeddings=64,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=_IMAGE_TOKEN,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    return transformers.LlavaForConditionalGeneration(config)


class _Pairs(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        text = torch.randint(0, 60, (8,), generator=g)
        return {
            "pixel_values": torch.randn(3, 32, 32, generator=g),
            "input_ids": torch.cat([torch.full((_PATCHES,), _IMAGE_TOKEN), text]),
        }


class _Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.llava = _llava()
        self.llava.model.vision_tower.requires_grad_(False)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        labels = batch["input_ids"].masked_fill(batch["input_ids"] == _IMAGE_TOKEN, -100)
        loss = self.llava(**batch, labels=labels).loss
        self.losses.append(loss.detach().clone())
        return loss

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_Pairs(), batch_size=6, shuffle=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _fit(cache: FrozenFeatureCache | None) -> tuple[_Task, list[int]]:
    L.seed_everything(0, verbose=False)
    task = _Task()
    rows: list[int] = []
    embeddings = task.llava.model.vision_tower.embeddings
    embeddings.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0]))
    trainer = L.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cache] if cache else [],
    )
    trainer.fit(task)
    return task, rows


@pytest.mark.parametrize("modules", ["auto", ["llava.model.vision_tower"]])
def test_llava_losses_are_bitwise_the_plain_runs_and_the_tower_is_skipped(modules: Any) -> None:
    plain, plain_rows = _fit(None)
    cache = FrozenFeatureCache(modules=modules)
    cached, rows = _fit(cache)
    assert len(plain.losses) == len(cached.losses) == 12
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, cached.losses, strict=True))
    assert plain_rows == [6] * 12
    assert list(cache.cache.modules) == ["llava.model.vision_tower"]  # type: ignore[union-attr]
    counts = cache.counts
    assert counts["stored"] == 24
    assert counts["stood_down"] == {}
    # epoch 1 runs 24 (auto stores the batch it found the tower in too), epoch 2 verifies
    # on its first batch (6), serves 18
    assert (counts["misses"], counts["hits"], rows) == (30, 42, [6] * 5)


#: Images per sample (a text-only sample has none), and each epoch's batches: [1, 1] first,
#: then batches whose image count equals their size by chance ([2, 0], [0, 2]).
_COUNTS = [1, 1, 2, 0, 2, 0]
_PLAN = [[[0, 1], [2, 3], [4, 5]], [[0, 1], [3, 4], [2, 5]], [[3, 4], [0, 1], [5, 2]]]


class _Album(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return len(_COUNTS)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        pixels = torch.randn(_COUNTS[i], 3, 32, 32, generator=g)
        text = torch.randint(0, 60, (8,), generator=g)
        return {
            "pixel_values": pixels,
            "input_ids": torch.cat([torch.full((_PATCHES * _COUNTS[i],), _IMAGE_TOKEN), text]),
        }


def _concatenated(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Llava's multi-image layout: the batch's images one after the other; texts padded left."""
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, item in enumerate(items):
        ids[row, longest - len(item["input_ids"]) :] = item["input_ids"]
        mask[row, longest - len(item["input_ids"]) :] = 1
    pixels = torch.cat([item["pixel_values"] for item in items])
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}


class _Plan(torch.utils.data.Sampler[list[int]]):
    def __init__(self) -> None:
        self.epoch = 0

    def __iter__(self) -> Any:
        self.epoch += 1
        return iter(_PLAN[(self.epoch - 1) % len(_PLAN)])

    def __len__(self) -> int:
        return len(_PLAN[0])


class _AlbumTask(_Task):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        labels = ids.masked_fill((ids == _IMAGE_TOKEN) | (batch["attention_mask"] == 0), -100)
        loss = self.llava(**batch, labels=labels).loss
        self.losses.append(loss.detach().clone())
        return loss

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_Album(), batch_sampler=_Plan(), collate_fn=_concatenated)


def test_llava_with_a_varying_number_of_images_per_sample_is_never_served_a_wrong_row() -> None:
    def run(cache: FrozenFeatureCache | None) -> list[torch.Tensor]:
        L.seed_everything(0, verbose=False)
        task = _AlbumTask()
        L.Trainer(
            max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            callbacks=[cache] if cache else [],
        ).fit(task)  # fmt: skip
        return task.losses

    plain = run(None)
    cache = FrozenFeatureCache()  # "auto" finds the tower: it takes `pixel_values` as it is
    cached = run(cache)
    assert all(torch.equal(a, b) for a, b in zip(plain, cached, strict=True))
    assert cache.counts["hits"] == 0
    why = cache.counts["stood_down"]["llava.model.vision_tower"]
    assert "its 2 rows are its 2 samples' 2, 0 rows concatenated" in why
