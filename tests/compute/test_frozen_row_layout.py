"""FrozenFeatureCache where a batch's rows need not be its samples: a varying number of
images per sample. Hugging Face Llava's multi-image ``pixel_values`` concatenates every
image of the batch; Idefics3 and SmolVLM give their tower
``pixel_values.view(B * N, ...)[real_images]``, made in the model. A batch of image counts
``[2, 0]`` has two rows for two samples, the second of them the first sample's second
image: no such row may be stored under the second sample's key, let alone served.

Each fit runs a plan of batches in which ``[2, 0]`` and ``[0, 2]`` batches follow ``[1, 1]``
ones, so that a cache filing rows by position serves a wrong image in the second epoch;
the losses must be bit for bit the plain run's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_speedkit.compute._frozen_core import cache_frozen_features
from lightning_speedkit.compute._frozen_layout import layout, why_not_rows
from lightning_speedkit.compute.frozen_feature_cache import FrozenFeatureCache
from tests.helpers.one_thread import one_intra_op_thread  # noqa: F401 (autouse)

from .test_frozen_newuser_common import fit, same_losses

#: Images per sample: text-only samples (0) and two-image ones mixed with one-image ones.
MIXED = {0: 2, 1: 0, 2: 1, 3: 1, 4: 0, 5: 2, 6: 1, 7: 1}
ONE_EACH = dict.fromkeys(range(8), 1)
#: Batches of each epoch: [1, 1] first (stored right), then [2, 0] and [0, 2] batches.
PLAN = [
    [[2, 3], [0, 1], [4, 5], [6, 7]],
    [[2, 3], [5, 1], [6, 7], [0, 4]],
    [[6, 7], [1, 5], [4, 0], [3, 2]],
]


def _image(index: int, number: int) -> torch.Tensor:
    return torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(10 * index + number))


class Album(Dataset[dict[str, Any]]):
    """Sample ``i`` holds ``counts[i]`` images (``(k, 3, 4, 4)``) and a label; asked to
    leave the images out, it gives zeros of their shape. ``built`` counts images made."""

    built = 0

    def __init__(self, counts: dict[int, int]) -> None:
        self.counts = counts

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        count = self.counts[index]
        Album.built += count
        images = [_image(index, n) for n in range(count)]
        pixels = torch.stack(images) if images else torch.zeros(0, 3, 4, 4)
        return {"pixel_values": pixels, "n_images": count, "label": index % 3}

    def speedkit_getitem(self, index: int, without: frozenset[str]) -> dict[str, Any]:
        if "pixel_values" not in without:
            return self[index]
        count = self.counts[index]
        return {"pixel_values": torch.zeros(count, 3, 4, 4), "n_images": count, "label": index % 3}


def concatenated(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Hugging Face Llava's layout: every image of the batch, one after the other."""
    return {
        "pixel_values": torch.cat([item["pixel_values"] for item in items]),
        "n_images": torch.tensor([item["n_images"] for item in items]),
        "label": torch.tensor([item["label"] for item in items]),
    }


def padded(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Idefics3's layout: ``(samples, most images, 3, 4, 4)``, missing images all zeros."""
    most = max(item["n_images"] for item in items) or 1
    pixels = torch.zeros(len(items), most, 3, 4, 4)
    for row, item in enumerate(items):
        pixels[row, : item["n_images"]] = item["pixel_values"]
    return {"pixel_values": pixels, "label": torch.tensor([item["label"] for item in items])}


class ListedAlbum(Album):
    """The images as a list under another name: the collate_fn makes ``pixel_values`` (as
    one that calls a processor does), so which sample each row is cannot be read off the
    samples."""

    def __getitem__(self, index: int) -> dict[str, Any]:
        return _listed(super().__getitem__(index))

    def speedkit_getitem(self, index: int, without: frozenset[str]) -> dict[str, Any]:
        return _listed(super().speedkit_getitem(index, without))


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    return {"images": list(item.pop("pixel_values")), **item}


def from_lists(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    stacked = [torch.stack(i["images"]) if i["images"] else torch.zeros(0, 3, 4, 4) for i in items]
    return concatenated([{**i, "pixel_values": p} for i, p in zip(items, stacked, strict=True)])


class Plan(Sampler[list[int]]):
    """The batches of :data:`PLAN`, one epoch's after another."""

    def __init__(self, plan: list[list[list[int]]]) -> None:
        self.plan, self.epoch = plan, 0

    def __iter__(self) -> Any:
        batches = self.plan[self.epoch % len(self.plan)]
        self.epoch += 1
        return iter(batches)

    def __len__(self) -> int:
        return len(self.plan[0])


def _tower() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(48, 8), nn.Tanh()).requires_grad_(False)


def pooled_concatenated(tower: nn.Module, pixels: torch.Tensor, counts: torch.Tensor) -> Any:
    """Each sample's images' features summed (Llava puts them at its image tokens)."""
    owners = torch.arange(len(counts)).repeat_interleave(counts)
    return torch.zeros(len(counts), 8).index_add(0, owners, tower(pixels))


def pooled_padded(tower: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Idefics3's way: the real images picked out of ``view(B * N, ...)`` in the model."""
    samples, most = pixels.shape[:2]
    flat = pixels.view(samples * most, 3, 4, 4)
    real = flat.flatten(1).abs().sum(1) != 0
    owners = torch.arange(samples).repeat_interleave(most)[real]
    return torch.zeros(samples, 8).index_add(0, owners, tower(flat[real]))


class AlbumVLM(L.LightningModule):
    layout = "concatenated"

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tower = _tower()
        self.head = nn.Linear(8, 3)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.layout == "padded":
            pooled = pooled_padded(self.tower, batch["pixel_values"])
        else:
            pooled = pooled_concatenated(self.tower, batch["pixel_values"], batch["n_images"])
        loss = F.cross_entropy(self.head(pooled), batch["label"])
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=0.5)


class PaddedVLM(AlbumVLM):
    layout = "padded"


def _fits(
    model: type[AlbumVLM], collate: Callable[..., Any], counts: dict[int, int], plan: Any,
    cache: FrozenFeatureCache, dataset: type[Album] = Album,
) -> tuple[AlbumVLM, AlbumVLM, list[str]]:  # fmt: skip
    def loader() -> DataLoader[Any]:
        return DataLoader(dataset(counts), batch_sampler=Plan(plan), collate_fn=collate)

    plain = fit(model, loader, None, epochs=len(plan))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cached = fit(model, loader, cache, epochs=len(plan))
    said = [str(w.message) for w in caught if "FrozenFeatureCache" in str(w.message)]
    return plain, cached, said


@pytest.mark.parametrize(
    ("collate", "modules", "says"),
    [
        (concatenated, ["tower"], "has not one row per sample: its 2 rows are its 2 samples' 2, 0"),
        (concatenated, "auto", "has not one row per sample: its 2 rows are its 2 samples' 2, 0"),
        (from_lists, ["tower"], "is cannot be checked: the collate_fn built it"),
    ],
    ids=["concatenated", "concatenated, auto", "built by the collate_fn"],
)
def test_images_concatenated_from_a_varying_count_per_sample_are_never_served(
    collate: Callable[..., Any], modules: Any, says: str
) -> None:
    # "auto" finds the tower in a [2, 0] batch: what it ran there must not be stored either
    plan = [[[0, 1], *epoch[1:]] if i == 0 else epoch for i, epoch in enumerate(PLAN)]
    plan = plan if modules == "auto" else PLAN
    cache = FrozenFeatureCache(modules=modules)
    dataset = ListedAlbum if collate is from_lists else Album
    plain, cached, said = _fits(AlbumVLM, collate, MIXED, plan, cache, dataset)
    assert same_losses(plain, cached, 12)
    assert cache.counts["hits"] == 0
    assert says in cache.counts["stood_down"]["tower"]
    assert sum("stopped serving `tower`: " in s for s in said) == 1
    assert 'key="<field>"` naming a batch field with one id per row' in said[0]


def test_images_picked_in_the_model_from_a_padded_field_are_never_served() -> None:
    cache = FrozenFeatureCache(modules=["tower"])  # its input is made in the model: named
    plain, cached, said = _fits(PaddedVLM, padded, MIXED, PLAN, cache)
    assert same_losses(plain, cached, 12)
    assert cache.counts["hits"] == 0
    why = cache.counts["stood_down"]["tower"]
    assert "made in the model from the batch's `pixel_values`, whose samples hold 2, 0 rows" in why
    assert "its rows are images, not samples" in why
    assert len(said) == 1


@pytest.mark.parametrize("layout", ["concatenated", "padded"])
def test_one_image_per_sample_is_served_in_either_layout(layout: str) -> None:
    model, collate = (AlbumVLM, concatenated) if layout == "concatenated" else (PaddedVLM, padded)
    cache = FrozenFeatureCache(modules=["tower"])
    plain, cached, said = _fits(model, collate, ONE_EACH, PLAN, cache)
    assert same_losses(plain, cached, 12)
    counts = cache.counts
    assert counts["stood_down"] == {}
    # epoch 1 stores 8; epoch 2 checks its first batch (2 run) and serves 6; epoch 3 all 8
    assert (counts["misses"], counts["hits"]) == (10, 14)
    if layout == "concatenated":  # the batch's field as it is: the loader leaves it out
        assert counts["inputs_skipped"] == 6 + 8
        assert said == []
    else:  # made in the model: served, but which field to leave out is not known
        assert counts["inputs_skipped"] == 0
        assert len(said) == 1
        assert "the loader builds every sample with its inputs" in said[0]
        assert "`tower` is called on an input made in the model" in said[0]


def test_a_left_out_image_is_read_again_with_its_whole_batch_when_rows_are_not_samples() -> None:
    # epochs 1-2 store and check [2, 3, 6]; epoch 3 builds sample 2 without its image, in a
    # batch whose image counts are [2, 1, 0]: the cache stands down and must run the tower
    # on the real images, where sample 2's image is the batch's third row, not its second
    plan = [[[2, 3, 6]], [[2, 3, 6]], [[0, 2, 1]]]
    cache = FrozenFeatureCache(modules=["tower"])
    plain, cached, _ = _fits(AlbumVLM, concatenated, MIXED, plan, cache)
    assert same_losses(plain, cached, 3)
    counts = cache.counts
    assert (counts["inputs_skipped"], counts["refetched"]) == (1, 1)
    assert "its 3 rows are its 3 samples' 2, 1, 0 rows" in counts["stood_down"]["tower"]


class Captions(Dataset[dict[str, Any]]):
    """A caption per sample, as a string (tokenized in the collate_fn) or as token ids in a
    list (as Hugging Face ``datasets`` give them)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, Any]:
        text = "abcdefgh"[index:] + "xyz"[: index % 3]
        ids = [ord(c) - 97 for c in text]
        if self.kind == "text":
            return {"caption": text, "label": index % 3}
        return {"input_ids": ids, "label": index % 3}


def tokenized(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    ids = [item.get("input_ids") or [ord(c) - 97 for c in item["caption"]] for item in items]
    padded = torch.zeros(len(ids), max(len(i) for i in ids), dtype=torch.long)
    for row, tokens in enumerate(ids):
        padded[row, : len(tokens)] = torch.tensor(tokens)
    return {"input_ids": padded, "label": torch.tensor([item["label"] for item in items])}


class TextProbe(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.text = nn.Embedding(26, 8).requires_grad_(False)
        self.head = nn.Linear(8, 3)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self.head(self.text(batch["input_ids"]).mean(1)), batch["label"])
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=0.5)


@pytest.mark.parametrize("kind", ["text", "token ids"])
def test_text_tokenized_in_the_collate_fn_is_served(kind: str) -> None:
    # a field built by the collate_fn (no per-sample shape to check) whose samples hold
    # nothing in a varying number is one row per sample: served, as before
    def loader() -> DataLoader[Any]:
        return DataLoader(Captions(kind), batch_size=2, shuffle=True, collate_fn=tokenized)

    plain = fit(TextProbe, loader, None)
    cache = FrozenFeatureCache(modules=["text"])
    cached = fit(TextProbe, loader, cache)
    assert same_losses(plain, cached, 12)
    assert cache.counts["stood_down"] == {}
    assert cache.counts["hits"] == 12  # a batch's padded length is part of the features' key


class Sentences(Dataset[dict[str, Any]]):
    """Token ids of lengths 12, 16, 9, 16 (as Hugging Face ``datasets`` give them), a label,
    and the sample's id."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, Any]:
        ids = [(index + t) % 26 for t in range((12, 16, 9, 16)[index % 4])]
        return {"input_ids": ids, "label": index % 3, "id": 100 + index}


def tokenized_with_ids(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {**tokenized(items), "id": torch.tensor([item["id"] for item in items])}


class LabelCode(nn.Module):
    """A frozen code of a number per sample: its input is 1-D, one number per row."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x[:, None] * self.weight)


class LabelProbe(TextProbe):
    def __init__(self) -> None:
        super().__init__()
        self.code = LabelCode()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        text = self.text(batch["input_ids"]).mean(1)
        coded = self.code(batch["label"].float())  # 1-D, made in the model
        loss = F.cross_entropy(self.head(text + coded), batch["label"])
        self.losses.append(loss.detach().clone())
        return loss


@pytest.mark.parametrize("key", ["index", "id"])
def test_a_one_dimensional_input_made_in_the_model_beside_padded_text_is_served(
    key: str,
) -> None:
    # token ids of varying lengths are one row per sample, not rows "shaped as" a number:
    # the 1-D input's rows are the samples, with the collate's layouts or with keys from
    # a batch field
    def loader() -> DataLoader[Any]:
        collate = tokenized_with_ids
        return DataLoader(Sentences(), batch_size=4, shuffle=True, collate_fn=collate)

    plain = fit(LabelProbe, loader, None)
    cache = FrozenFeatureCache(modules=["code"], key=key)
    cached = fit(LabelProbe, loader, cache)
    assert same_losses(plain, cached, 6)
    assert cache.counts["stood_down"] == {}
    # epoch 1 stores 8; epoch 2 checks its first batch (4 run) and serves 4; epoch 3 all 8
    assert (cache.counts["misses"], cache.counts["hits"]) == (12, 12)


@pytest.mark.parametrize("collated", [True, False], ids=["layouts", "no layouts"])
def test_a_number_per_row_is_never_taken_for_images(collated: bool) -> None:
    items = [Sentences()[i] for i in range(4)]  # token ids of lengths 12, 16, 9, 16
    batch = tokenized_with_ids(items)
    layouts = layout(items, batch) if collated else None
    assert layouts is None or layouts["input_ids"].counts == (1, 1, 1, 1)
    assert why_not_rows(None, [batch["label"].float()], batch, layouts, 4) is None


# -- without a Trainer ---------------------------------------------------------------------


class PaddedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tower = _tower()
        self.head = nn.Linear(8, 3)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.head(pooled_padded(self.tower, pixel_values))


def _batch(keys: list[int], collate: Callable[..., Any]) -> dict[str, torch.Tensor]:
    album = Album(MIXED)
    return collate([album[i] for i in keys])


def test_without_a_trainer_the_model_call_shows_images_picked_from_a_padded_field() -> None:
    model = PaddedModel()
    steps = [[2, 3], [0, 1], [2, 3], [1, 5]]
    with torch.no_grad():
        expected = [model(_batch(keys, padded)["pixel_values"]) for keys in steps]
    cache = cache_frozen_features(model, ["tower"])
    for keys, want in zip(steps, expected, strict=True):
        with cache.keys(keys), torch.no_grad():  # the model's own call: no batch given
            assert torch.equal(model(pixel_values=_batch(keys, padded)["pixel_values"]), want)
    assert cache.counts()["hits"] == 0
    why = cache.counts()["stood_down"]["tower"]
    assert "from the model's input `pixel_values`, whose samples hold up to 2 rows" in why


def test_without_a_trainer_one_key_per_image_serves_concatenated_images() -> None:
    tower = _tower()
    steps = [[2, 3], [0, 1], [4, 5], [5, 1], [0, 4], [1, 5]]
    model = nn.Sequential(tower)
    cache = cache_frozen_features(model, ["0"])
    for keys in steps:
        batch = _batch(keys, concatenated)
        images = [(i, n) for i in keys for n in range(MIXED[i])]  # one key per image
        with cache.keys(images), torch.no_grad():
            served = model(batch["pixel_values"])
        assert torch.equal(served, tower(batch["pixel_values"]))
    counts = cache.counts()
    assert counts["stood_down"] == {}
    assert counts["hits"] == 4  # step 4 reuses images first (checked), steps 5 and 6 serve


def test_without_a_trainer_the_check_names_rows_that_are_not_one_per_key() -> None:
    # sample keys for HF Llava's concatenated images, which the keys alone cannot show:
    # [0, 1] files sample 0's second image under key 1; its first reuse is checked
    tower = _tower()
    model = nn.Sequential(tower)
    cache = cache_frozen_features(model, ["0"])
    for keys in ([0, 1], [1, 5]):
        pixels = _batch(keys, concatenated)["pixel_values"]
        with cache.keys(keys), torch.no_grad():
            assert torch.equal(model(pixels), tower(pixels))
    why = cache.counts()["stood_down"]["0"]
    assert "most likely its input's rows not being one per key" in why
    assert "key each image instead" in why


def test_calls_with_no_row_per_sample_are_said_once_whatever_their_shape() -> None:
    model = nn.Sequential(_tower())
    cache = cache_frozen_features(model, ["0"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (3, 5, 6, 3):  # patches or images, not the batch's two samples
            with cache.keys([0, 1]), torch.no_grad():
                model(torch.randn(rows, 3, 4, 4))
    said = [str(w.message) for w in caught if "has no row per sample" in str(w.message)]
    assert len(said) == 1
    assert "Qwen2-VL's flattened patches" in said[0]
    assert "key each row" in said[0]
    assert cache.counts()["plain_calls"] == 4
