"""The loader's half of FrozenFeatureCache: served samples come without their images.

A dataset that defines ``speedkit_getitem(index, without)`` (the example's does) is asked
for ready samples without the cached module's input; the losses stay bit for bit the
plain run's, and a stand-in never reaches a module: rows whose features are gone are
read again in full first.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit.compute._frozen_loader import IndexedCollate, IndexedDataset
from lightning_speedkit.compute._frozen_skip import SkipPlan, can_skip
from lightning_speedkit.compute.frozen_feature_cache import FrozenFeatureCache
from speedkit_examples.vlm.data import CaptionShardDataset

from .test_frozen_feature_cache import _fit


class Reads:
    """Which samples the example dataset built in full, and which without their image."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full: Counter[int] = Counter()
        self.without: Counter[int] = Counter()
        full, without = CaptionShardDataset.__getitem__, CaptionShardDataset.speedkit_getitem

        def count_full(dataset: Any, index: int) -> Any:
            self.full[int(index)] += 1
            return full(dataset, index)

        def count_without(dataset: Any, index: int, fields: frozenset[str]) -> Any:
            self.without[int(index)] += 1
            return without(dataset, index, fields)

        monkeypatch.setattr(CaptionShardDataset, "__getitem__", count_full)
        monkeypatch.setattr(CaptionShardDataset, "speedkit_getitem", count_without)


def test_served_samples_are_not_decoded_and_the_losses_are_the_plain_runs(
    small_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, plain, _ = _fit(small_corpus, 4, None)
    reads = Reads(monkeypatch)
    cache = FrozenFeatureCache(modules=["model.vision"])
    _, cached, runs = _fit(small_corpus, 4, cache)
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, cached.losses, strict=True))
    # Epoch 1 decodes all 96; epoch 2's first batch is decoded for the check (16), after
    # which every stored sample is ready: the other 80 of epoch 2 and all of epochs 3-4
    # come without their images, and the tower runs only for the check. Three more are
    # read twice when the fit starts: the dataset's fingerprint (first, middle, last).
    assert sum(reads.full.values()) == 96 + 16 + 3 * 2  # each twice, under two seeds
    assert sum(reads.without.values()) == 80 + 96 + 96
    assert cache.counts["inputs_skipped"] == 80 + 96 + 96
    assert cache.counts["refetched"] == 0
    assert runs == [16] * 7


def test_with_loader_workers_the_losses_stay_the_plain_runs(small_corpus: Path) -> None:
    _, plain, _ = _fit(small_corpus, 4, None, workers=2)
    cache = FrozenFeatureCache(modules=["model.vision"])
    _, cached, runs = _fit(small_corpus, 4, cache, workers=2)
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, cached.losses, strict=True))
    # The workers build batches ahead: those built before the check came whole. Every
    # later one comes without images (epoch 4 entirely), and no stand-in is read again.
    assert cache.counts["inputs_skipped"] >= 96 + 16
    assert cache.counts["refetched"] == 0
    assert runs == [16] * 7


class DropAt(Callback):
    """Forget every stored feature before batch ``at``: the loader's stand-ins miss."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        self.seen += 1
        if self.seen == self.at:
            cache = next(c for c in trainer.callbacks if isinstance(c, FrozenFeatureCache))  # type: ignore[attr-defined]
            assert cache.cache is not None
            cache.cache.store.drop()  # behind the modules' backs: their ready sets stay


def test_a_stand_in_whose_features_are_gone_is_read_again_in_full(small_corpus: Path) -> None:
    _, plain, _ = _fit(small_corpus, 3, None)
    cache = FrozenFeatureCache(modules=["model.vision"])
    _, cached, runs = _fit(small_corpus, 3, cache, extra=(DropAt(14),))
    # From batch 14 the loader still leaves images out, but the store is empty: each such
    # batch's images are read again in the training process before the tower runs.
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, cached.losses, strict=True))
    assert cache.counts["refetched"] == 16 * 5
    assert runs == [16] * 7 + [16] * 5


class Numbers(Dataset[dict[str, Any]]):
    """Samples whose ``x`` is costly; ``speedkit_getitem`` leaves it out (a stand-in of -1)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"x": torch.full((2,), float(index)), "id": index}

    def speedkit_getitem(self, index: int, without: frozenset[str]) -> dict[str, Any]:
        item = self[index]
        for field in without:
            item[field] = torch.full((2,), -1.0)
        return item


@pytest.mark.parametrize("workers", [0, 2])
def test_the_plan_reaches_the_loader_workers_through_shared_memory(workers: int) -> None:
    plan = SkipPlan(8)
    loader = DataLoader(
        IndexedDataset(Numbers(), plan),
        batch_size=4,
        num_workers=workers,
        collate_fn=IndexedCollate(None),
        persistent_workers=workers > 0,
    )
    first = list(loader)
    assert [b["speedkit_index"].stand_ins for b in first] == [[], []]
    plan.set_fields(["x"])
    plan.mark([1, 2, 6])  # after the workers started: they read the shared flags
    again = list(loader)
    assert [b["speedkit_index"].stand_ins for b in again] == [[1, 2], [2]]
    assert again[0]["x"][:, 0].tolist() == [0.0, -1.0, -1.0, 3.0]
    plan.clear()
    assert [b["speedkit_index"].stand_ins for b in loader] == [[], []]


def test_only_a_dataset_that_says_so_is_asked_for_samples_without_fields() -> None:
    assert can_skip(Numbers())
    assert not can_skip(torch.utils.data.TensorDataset(torch.zeros(2)))
    assert can_skip(CaptionShardDataset.__new__(CaptionShardDataset))


def test_a_sample_cache_serves_what_it_holds_and_asks_the_dataset_for_the_rest() -> None:
    from lightning_speedkit.data import SampleCache

    cache = SampleCache(Numbers(), max_bytes=2 * Numbers()[0]["x"].nbytes + 64)
    _ = cache[0], cache[1]  # kept in memory
    kept = cache.speedkit_getitem(0, frozenset({"x"}))
    assert kept is cache[0]  # as it is: no cost, and nothing is left out
    fresh = cache.speedkit_getitem(5, frozenset({"x"}))
    assert fresh["x"].tolist() == [-1.0, -1.0]  # the dataset's stand-in, not kept
    assert 5 not in {k for k in cache._samples}
    plain = SampleCache(torch.utils.data.TensorDataset(torch.arange(4.0)))
    assert plain.speedkit_getitem(2, frozenset({"x"})) == (torch.tensor(2.0),)
