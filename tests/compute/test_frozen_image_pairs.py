"""A frozen tower called twice a step on two images per sample (an image pair, as in visual
reasoning or change detection): both calls are served, and the loader stops building both
images of a served sample."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit.compute.frozen_feature_cache import FrozenFeatureCache

from .test_frozen_newuser_common import fit, same_losses
from .test_frozen_newuser_data import Classifier, Folder


class Pairs(Dataset[dict[str, Any]]):
    """Samples ``{"left", "right", "label"}``; ``built`` counts the images really made."""

    built = 0

    def __init__(self) -> None:
        self.folder = Folder(size=24)

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> dict[str, Any]:
        Pairs.built += 2
        left, label = self.folder[index]
        right, _ = self.folder[(index + 7) % len(self.folder)]
        return {"left": left, "right": right, "label": label}

    def speedkit_getitem(self, index: int, without: frozenset[str]) -> dict[str, Any]:
        Pairs.built += 2 - len(without & {"left", "right"})
        stand_in = torch.zeros(3, 8, 8)
        left, label = (stand_in, index % 3) if "left" in without else self.folder[index]
        right = stand_in if "right" in without else self.folder[(index + 7) % 24][0]
        return {"left": left, "right": right, "label": label}


class PairClassifier(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        features = self.tower(batch["left"]) - self.tower(batch["right"])
        loss = F.cross_entropy(self.head(features), batch["label"])
        self.losses.append(loss.detach().clone())
        return loss


def test_both_images_of_a_pair_are_served_and_not_built() -> None:
    def loader() -> DataLoader[Any]:
        return DataLoader(Pairs(), batch_size=6, shuffle=True)

    Pairs.built = 0
    plain = fit(PairClassifier, loader, None)
    plain_built, Pairs.built = Pairs.built, 0
    cache = FrozenFeatureCache(modules=["tower"])
    cached = fit(PairClassifier, loader, cache)
    assert same_losses(plain, cached, 12)
    assert plain_built == 3 * 24 * 2
    # epoch 1 runs both images of 24 samples; epoch 2's first batch checks each call
    assert cached.tower.rows == [6] * 10
    counts = cache.counts
    assert (counts["misses"], counts["stored"], counts["hits"]) == (60, 48, 84)
    slots = cache.cache.cached["tower"].slots  # type: ignore[union-attr]
    assert sorted(slots, key=str) == [("field", "left"), ("field", "right")]
    # left out: epoch 2's samples after its first batch (which checks) and all of epoch 3's
    assert cache.cache.skipped == 18 + 24  # type: ignore[union-attr]
    # both images of each; the dataset's fingerprint builds three samples in full, twice
    # (under two seeds: what is drawn at random is left out of it)
    assert Pairs.built == plain_built - 2 * (18 + 24) + 2 * 3 * 2
