"""FrozenFeatureCache as a new user meets it: their datasets, samplers and training steps.

Each test trains a tiny frozen tower and a trainable head twice from the same seed,
without and with the cache, and asserts the losses are bit for bit equal and how often
the tower really ran; a case the cache cannot serve must say so in one line and still
train exactly.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, Sampler, random_split

from lightning_speedkit.compute.frozen_feature_cache import FrozenFeatureCache
from lightning_speedkit.errors import SpeedkitConfigError

from .test_frozen_newuser_common import Tower, fit, same_losses
from .test_frozen_skip import DropAt

# -- a torchvision look-alike (torchvision does not install beside the CPU torch here) ------


class ToTensor:
    def __call__(self, picture: Image.Image) -> torch.Tensor:
        array = np.asarray(picture, dtype=np.float32) / 255.0
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()


class Normalize:
    def __init__(self, mean: list[float], std: list[float]) -> None:
        self.mean, self.std = torch.tensor(mean)[:, None, None], torch.tensor(std)[:, None, None]

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return (image - self.mean) / self.std


class Compose:
    def __init__(self, steps: list[Any]) -> None:
        self.steps = steps

    def __call__(self, value: Any) -> Any:
        for step in self.steps:
            value = step(value)
        return value


class Folder(Dataset[tuple[torch.Tensor, int]]):
    """An ImageFolder look-alike: ``(transform(PIL image), class index)`` tuples."""

    def __init__(self, size: int = 24) -> None:
        self.size = size
        self.transform = Compose([ToTensor(), Normalize([0.5, 0.5, 0.5], [0.25, 0.25, 0.25])])

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        pixels = np.random.default_rng(int(index)).integers(0, 256, (8, 8, 3), dtype=np.uint8)
        return self.transform(Image.fromarray(pixels)), int(index) % 3


class Classifier(L.LightningModule):
    """A frozen tower and a trainable head; a batch is ``[images, labels]``."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = Tower().requires_grad_(False)
        self.head = nn.Linear(8, 3)
        self.losses: list[torch.Tensor] = []

    def inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return batch[0], batch[1]

    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.tower(images)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = self.inputs(batch)
        logits = self.head(self.features(images))
        loss = F.cross_entropy(logits, labels[: len(logits)])
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def _pictures() -> DataLoader[Any]:
    return DataLoader(Folder(), batch_size=6, shuffle=True)


@pytest.mark.parametrize("modules", ["auto", ["tower"]])
def test_a_torchvision_style_dataset_of_picture_and_label_tuples(modules: Any) -> None:
    plain = fit(Classifier, _pictures, None)
    cache = FrozenFeatureCache(modules=modules)
    cached = fit(Classifier, _pictures, cache)
    assert same_losses(plain, cached, 12)
    assert cache.cache is not None
    assert list(cache.cache.modules) == ["tower"]
    counts, rows = cache.counts, cached.tower.rows
    # epoch 1 runs 24 ("auto" stores the batch it found the tower in too); epoch 2's first
    # batch is checked (6 run); 18 + 24 served
    assert (counts["misses"], counts["hits"], rows) == (30, 42, [6] * 5)


# -- dict samples with strings, string ids as the key ---------------------------------------


class Captioned(Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> dict[str, Any]:
        image, label = Folder()[index]
        return {"image": image, "label": label, "caption": f"thing {index}", "id": f"im{index:03d}"}


class CaptionClassifier(Classifier):
    def inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert batch["id"][0].startswith("im")
        assert batch["caption"][0].startswith("thing")
        return batch["image"], batch["label"]


def _captioned() -> DataLoader[Any]:
    return DataLoader(Captioned(), batch_size=6, shuffle=True)


def test_string_ids_as_the_key_serve_in_memory_and_from_disk(tmp_path: Path) -> None:
    plain = fit(CaptionClassifier, _captioned, None)
    cache = FrozenFeatureCache(modules=["tower"], key="id", directory=tmp_path)
    cached = fit(CaptionClassifier, _captioned, cache)
    assert same_losses(plain, cached, 12)
    assert (cache.counts["misses"], cache.counts["hits"], cached.tower.rows) == (30, 42, [6] * 5)
    assert cache.counts["disk_bytes"] == 24 * 32  # 8 floats a sample, written at epoch 1's end
    one_epoch = fit(CaptionClassifier, _captioned, None, epochs=1)
    warm = FrozenFeatureCache(modules=["tower"], key="id", directory=tmp_path)
    served = fit(CaptionClassifier, _captioned, warm, epochs=1)  # a new cache: the folder only
    assert same_losses(one_epoch, served, 4)
    assert (warm.counts["hits"], served.tower.rows) == (18, [6])  # one batch checks


# -- namedtuple samples: their fields are fixed, so the index cannot ride along ------------

Sample = collections.namedtuple("Sample", "image label id")


class Named(Folder):
    def __getitem__(self, index: int) -> Any:
        return Sample(*super().__getitem__(index), f"im{index:03d}")


class NamedClassifier(Classifier):
    def inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return batch.image, batch.label  # attribute access: the batch must stay a namedtuple


def test_a_namedtuple_batch_is_keyed_by_its_field_and_refused_the_index_with_the_fix() -> None:
    def loader() -> DataLoader[Any]:
        return DataLoader(Named(), batch_size=6, shuffle=True)

    with pytest.raises(SpeedkitConfigError, match=r"namedtuple batch \(Sample.*`key='<field>'`"):
        fit(NamedClassifier, loader, FrozenFeatureCache(modules=["tower"]))
    plain = fit(NamedClassifier, loader, None)
    cache = FrozenFeatureCache(modules=["tower"], key="id")
    cached = fit(NamedClassifier, loader, cache)
    assert same_losses(plain, cached, 12)
    assert (cache.counts["misses"], cache.counts["hits"]) == (30, 42)


# -- a dataset that fetches a batch at once (as Hugging Face datasets do) -------------------


class Batched(Folder):
    def __init__(self) -> None:
        super().__init__()
        self.fetches = 0

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        self.fetches += 1
        return [self[i] for i in indices]


def test_a_dataset_with_getitems_keeps_its_batched_fetch_and_the_index() -> None:
    made: list[Batched] = []

    def loader() -> DataLoader[Any]:
        made.append(Batched())
        return DataLoader(made[-1], batch_size=6, shuffle=True)

    plain = fit(Classifier, loader, None)
    cache = FrozenFeatureCache(modules=["tower"])
    cached = fit(Classifier, loader, cache)
    assert same_losses(plain, cached, 12)
    assert [dataset.fetches for dataset in made] == [12, 12]  # every batch, one fetch
    assert (cache.counts["misses"], cache.counts["hits"]) == (30, 42)


def test_a_random_split_subset_as_most_users_make_one() -> None:
    def loader() -> DataLoader[Any]:  # torch's Subset fetches batches with __getitems__
        split = torch.Generator().manual_seed(0)
        train, _ = random_split(Folder(30), [24, 6], generator=split)
        return DataLoader(train, batch_size=6, shuffle=True)

    plain = fit(Classifier, loader, None)
    cache = FrozenFeatureCache(modules=["tower"])
    cached = fit(Classifier, loader, cache)
    assert same_losses(plain, cached, 12)
    assert (cache.counts["misses"], cache.counts["hits"]) == (30, 42)


# -- a multi-scale batch sampler whose indices are (index, size) pairs ----------------------


class Scales(Dataset[tuple[torch.Tensor, int]]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: tuple[int, int]) -> tuple[torch.Tensor, int]:
        i, size = index
        return torch.randn(3, size, size, generator=torch.Generator().manual_seed(i)), i % 3


class ScaleBatches(Sampler[list[tuple[int, int]]]):
    """Batches of 6 samples at one size each: 8 pixels, then 12, and so on."""

    def __iter__(self) -> Any:
        for b in range(4):
            yield [(i, 8 if b % 2 == 0 else 12) for i in range(6 * b, 6 * b + 6)]

    def __len__(self) -> int:
        return 4


def test_indices_that_are_not_ints_are_the_keys_as_they_are() -> None:
    def loader() -> DataLoader[Any]:
        return DataLoader(Scales(), batch_sampler=ScaleBatches())

    plain = fit(Classifier, loader, None)
    cache = FrozenFeatureCache(modules=["tower"])
    cached = fit(Classifier, loader, cache)
    assert same_losses(plain, cached, 12)
    assert (cache.counts["misses"], cache.counts["hits"], cached.tower.rows) == (30, 42, [6] * 5)
    assert cache.cache is not None
    assert (6, 12) in cache.cache.cached["tower"].ready


# -- two frozen towers, and a dataset that can leave both inputs out ------------------------


class Clips(Dataset[dict[str, Any]]):
    def __init__(self) -> None:
        self.full = self.without = 0

    def __len__(self) -> int:
        return 24

    def build(self, index: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(int(index))
        image, audio = torch.randn(3, 8, 8, generator=g), torch.randn(3, 4, 16, generator=g)
        return {"image": image, "audio": audio, "label": int(index) % 3}

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.full += 1
        return self.build(index)

    def speedkit_getitem(self, index: int, without: frozenset[str]) -> dict[str, Any]:
        if not {"image", "audio"} <= without:
            return self[index]
        self.without += 1
        return {"image": torch.zeros(3, 8, 8), "audio": torch.zeros(3, 4, 16), "label": index % 3}


class ImageAndAudio(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.image, self.audio = Tower().requires_grad_(False), Tower().requires_grad_(False)
        self.head = nn.Linear(16, 3)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        both = torch.cat([self.image(batch["image"]), self.audio(batch["audio"])], dim=1)
        loss = F.cross_entropy(self.head(both), batch["label"])
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def test_two_frozen_towers_are_both_served_and_the_loader_leaves_both_inputs_out() -> None:
    made: list[Clips] = []

    def loader() -> DataLoader[Any]:
        made.append(Clips())
        return DataLoader(made[-1], batch_size=6, shuffle=True)

    plain = fit(ImageAndAudio, loader, None)
    cache = FrozenFeatureCache()  # "auto" finds both
    cached = fit(ImageAndAudio, loader, cache)
    assert same_losses(plain, cached, 12)
    assert cache.cache is not None
    assert sorted(cache.cache.modules) == ["audio", "image"]
    assert cached.image.rows == cached.audio.rows
    data = made[1]
    assert data.without == cache.counts["inputs_skipped"] >= 24  # epoch 3 at least
    assert data.full + data.without == 72 + 3 * 2  # and 3 read twice for the fingerprint


# -- what the cache cannot serve: one line, and the plain run's losses ----------------------


class TwoViews(Classifier):
    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.tower(images) + self.tower(images.flip(-1))


class HalfBatch(Classifier):
    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.tower(images[: len(images) // 2])


def test_a_tower_on_part_of_the_batch_says_so_and_trains_exactly() -> None:
    plain = fit(HalfBatch, _pictures, None)
    cache = FrozenFeatureCache(modules=["tower"])
    message = r"runs `tower` without the store: its input `0` \(shape \(3, 3, 8, 8\)\)"
    with pytest.warns(UserWarning, match=message):
        cached = fit(HalfBatch, _pictures, cache)
    assert same_losses(plain, cached, 12)
    assert cached.tower.rows == plain.tower.rows
    assert cache.counts["hits"] == 0


def test_a_tower_called_on_two_views_serves_both() -> None:
    plain = fit(TwoViews, _pictures, None)
    cache = FrozenFeatureCache(modules=["tower"])
    cached = fit(TwoViews, _pictures, cache)
    assert same_losses(plain, cached, 12)
    assert plain.tower.rows == [6] * 24  # two calls a step
    # epoch 1 runs both views (8 calls); epoch 2's first batch checks each view (2 calls)
    assert cached.tower.rows == [6] * 10
    counts = cache.counts
    assert (counts["misses"], counts["stored"], counts["hits"]) == (60, 48, 84)
    assert sorted(cache.cache.cached["tower"].slots, key=str) == [("call", 0), ("field", 0)]


# -- validation and prediction run the tower; the cache serves training only ----------------


class Evaluated(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.val_losses: list[torch.Tensor] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        before = len(self.tower.rows)
        self.val_losses.append(F.cross_entropy(self.head(self.tower(batch[0])), batch[1]))
        assert len(self.tower.rows) == before + 1  # it ran

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.head(self.tower(batch[0]))


def test_validation_and_predict_run_the_tower_and_match_the_plain_run() -> None:
    def loaders() -> tuple[DataLoader[Any], DataLoader[Any]]:
        return _pictures(), DataLoader(Folder(12), batch_size=6)

    plain = fit(Evaluated, loaders, None)
    cache = FrozenFeatureCache(modules=["tower"])
    cached = fit(Evaluated, loaders, cache)
    assert same_losses(plain, cached, 12)
    assert len(cached.val_losses) == 6
    assert all(torch.equal(a, b) for a, b in zip(plain.val_losses, cached.val_losses, strict=True))
    assert cache.counts["hits"] == 42
    assert "forward" not in vars(cached.tower)  # the fit took the store off again
    rows = len(cached.tower.rows)
    again = [
        cached.trainer.predict(m, DataLoader(Folder(12), batch_size=6)) for m in (plain, cached)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*again, strict=True))  # type: ignore[arg-type]
    assert len(cached.tower.rows) == rows + 2


# -- Trainer settings --------------------------------------------------------------------------


def test_accumulated_gradients_and_a_limit_on_train_batches() -> None:
    options = {"accumulate_grad_batches": 2, "limit_train_batches": 3}
    plain = fit(Classifier, _pictures, None, **options)
    cache = FrozenFeatureCache(modules=["tower"])
    cached = fit(Classifier, _pictures, cache, **options)
    assert same_losses(plain, cached, 9)
    counts = cache.counts
    assert counts["hits"] + counts["misses"] == 54
    assert counts["hits"] >= 18  # epoch 2's batches after the check hold stored samples


def test_features_of_a_float32_fit_are_not_served_to_a_bf16_mixed_fit(tmp_path: Path) -> None:
    fit(Classifier, _pictures, FrozenFeatureCache(modules=["tower"], directory=tmp_path), epochs=1)
    plain = fit(Classifier, _pictures, None, precision="bf16-mixed")
    cache = FrozenFeatureCache(modules=["tower"], directory=tmp_path, verify=False)
    cached = fit(Classifier, _pictures, cache, precision="bf16-mixed")
    assert same_losses(plain, cached, 12)
    assert (cache.counts["hits"], cached.tower.rows) == (48, [6] * 4)  # epoch 1 ran, in bf16
    assert cache.counts["store_bytes"] == 24 * 8 * 2  # the features autocast made: bfloat16
    assert cache.counts["disk_other_bytes"] == 24 * 32  # the float32 fit's, kept apart


class Bf16Tower(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.tower.to(torch.bfloat16)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.tower(images.to(torch.bfloat16)).float()


def test_a_tower_moved_to_bfloat16_is_served_in_bfloat16() -> None:
    plain = fit(Bf16Tower, _pictures, None)
    cache = FrozenFeatureCache(modules=["tower"])
    cached = fit(Bf16Tower, _pictures, cache)
    assert same_losses(plain, cached, 12)
    assert (cache.counts["misses"], cache.counts["hits"]) == (30, 42)
    assert cache.counts["store_bytes"] == 24 * 8 * 2


# -- a batch hook that changes the tower's input: rows read again go through it too ----------


class Pictures(Captioned):
    def speedkit_getitem(self, index: int, without: frozenset[str]) -> dict[str, Any]:
        item = self[index]
        item["image"] = torch.zeros_like(item["image"])
        return item


class Rescaled(CaptionClassifier):
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        batch["image"] = batch["image"] * 4.0 - 1.0
        return batch


def test_rows_read_again_pass_through_the_batch_hooks_as_the_loaders_did() -> None:
    def loader() -> DataLoader[Any]:
        return DataLoader(Pictures(), batch_size=6, shuffle=True)

    plain = fit(Rescaled, loader, None)
    cache = FrozenFeatureCache(modules=["tower"])
    cached = fit(Rescaled, loader, cache, extra=(DropAt(10),))  # features gone in epoch 3
    assert same_losses(plain, cached, 12)
    assert cache.counts["refetched"] == 18  # batches 10-12 came without images


# -- torchdata's StatefulDataLoader, made outside a hook ------------------------------------


def _stateful_pictures() -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(Folder(), batch_size=6, shuffle=True,
                              generator=torch.Generator().manual_seed(1))  # fmt: skip


def test_a_shuffled_stateful_dataloader_keeps_its_class_and_its_order() -> None:
    """Built again to carry the index, it was a torch DataLoader over the same sampler
    (both the batch sampler it keeps and the batch size it was given, which DataLoader
    refuses together): torchdata's sampler then ordered every epoch otherwise, and the
    losses were not the plain run's (6.1 off, measured)."""
    pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata (test extra)")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_speedkit.compute._frozen_loader import with_sample_index

    assert type(with_sample_index(_stateful_pictures())) is StatefulDataLoader
    plain = fit(Classifier, _stateful_pictures, None)
    cache = FrozenFeatureCache(modules=["tower"])
    cached = fit(Classifier, _stateful_pictures, cache)
    assert same_losses(plain, cached, 12)
    assert cache.counts["hits"] == 42


class _Reversed(torch.utils.data.Sampler[int]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Any:
        return iter(range(self.size - 1, -1, -1))

    def __len__(self) -> int:
        return self.size


@pytest.mark.parametrize("how", ["batching off", "batch sampler", "batch size"])
def test_a_stateful_dataloader_is_built_again_with_the_batching_it_was_made_with(
    how: str,
) -> None:
    """Each of the three ways a loader makes its batches survives the rebuild as its own
    class (made outside a hook: from its attributes), to the batch. Batching off came
    back batching by 1 in a plain order, for one draft of the fix."""
    pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata (test extra)")
    from torch.utils.data import BatchSampler
    from torchdata.stateful_dataloader import StatefulDataLoader

    from lightning_speedkit import _compat

    data = [{"x": torch.tensor([i, i])} for i in range(6)]
    if how == "batching off":  # a dataset of ready batches, in the sampler's order
        loader = StatefulDataLoader(data, batch_size=None, sampler=_Reversed(6))
    elif how == "batch sampler":
        loader = StatefulDataLoader(data, batch_sampler=BatchSampler(_Reversed(6), 4, False))
    else:
        loader = StatefulDataLoader(data, batch_size=4, sampler=_Reversed(6), drop_last=True)
    rebuilt = _compat.dataloader_built_again(loader, {"worker_init_fn": print})
    assert type(rebuilt) is StatefulDataLoader
    assert [b["x"].tolist() for b in rebuilt] == [b["x"].tolist() for b in loader]
