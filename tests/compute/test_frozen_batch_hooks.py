"""FrozenFeatureCache(key="index") and the user's batch hooks: the hooks get the batch their
collate_fn made, never the dataset index the cache's loader carries in it.

Before, a list batch reached ``on_before_batch_transfer`` with one more item, so
``x, y = batch`` raised; a tuple batch came as a list; a dict hook that rebuilt the batch
dropped the index and was refused. Each test trains with and without the cache from one
seed and asserts the losses equal bit for bit and the tower really served.
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit.compute._frozen_loader import INDEX_FIELD, IndexTaker, SampleIndex
from lightning_speedkit.compute.frozen_feature_cache import FrozenFeatureCache

from .test_frozen_newuser_common import fit, same_losses
from .test_frozen_newuser_data import Classifier, Folder


class Unpacking(Classifier):
    """Hooks written for a ``(images, labels)`` batch, as the collate_fn makes it."""

    seen: list[type]

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        images, labels = batch  # one item more raised "too many values to unpack"
        self.seen = [*getattr(self, "seen", []), type(batch)]
        return type(batch)((images * 2.0, labels))

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        images, labels = batch
        return images / 2.0, labels


def _tuples(items: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([i[0] for i in items]), torch.tensor([i[1] for i in items])


@pytest.mark.parametrize("kind", [list, tuple])
def test_hooks_that_unpack_a_list_or_tuple_batch_get_it_as_the_collate_made_it(
    kind: type,
) -> None:
    def loader() -> DataLoader[Any]:
        collate = None if kind is list else _tuples  # default_collate gives a list
        return DataLoader(Folder(), batch_size=6, shuffle=True, collate_fn=collate)

    plain = fit(Unpacking, loader, None)
    cache = FrozenFeatureCache(modules=["tower"])
    cached = fit(Unpacking, loader, cache)
    assert same_losses(plain, cached, 12)
    assert set(cached.seen) == set(plain.seen) == {kind}
    # epoch 1 runs 24; epoch 2's first batch is checked (6 run); 18 + 24 served
    assert (cache.counts["misses"], cache.counts["hits"]) == (30, 42)


class Pictures(Dataset[dict[str, Any]]):
    def __init__(self) -> None:
        self.folder = Folder()

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> dict[str, Any]:
        image, label = self.folder[index]
        return {"image": image, "label": label}


class Rebuilding(Classifier):
    """A dict hook that builds a new batch from every field (a SampleIndex has no ``*``)."""

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        assert INDEX_FIELD not in batch
        return {name: value * 1 for name, value in batch.items()}

    def inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return batch["image"], batch["label"]


def test_a_dict_hook_that_returns_a_new_batch_is_served() -> None:
    def loader() -> DataLoader[Any]:
        return DataLoader(Pictures(), batch_size=6, shuffle=True)

    plain = fit(Rebuilding, loader, None)
    cache = FrozenFeatureCache(modules=["tower"])
    cached = fit(Rebuilding, loader, cache)
    assert same_losses(plain, cached, 12)
    assert (cache.counts["misses"], cache.counts["hits"]) == (30, 42)


class PluginSeen(L.Callback):
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.plugin = trainer.precision_plugin
        self.wrapped = "convert_input" in vars(self.plugin)


class Raising(Classifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            raise RuntimeError("a fault in the step")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("model", [Classifier, Raising])
def test_the_plugin_is_as_it_was_after_the_fit_or_a_fault(model: type[Classifier]) -> None:
    cache, seen = FrozenFeatureCache(modules=["tower"]), PluginSeen()
    with contextlib.nullcontext() if model is Classifier else pytest.raises(RuntimeError):
        fit(model, lambda: DataLoader(Folder(), batch_size=6), cache, epochs=1, extra=(seen,))
    assert seen.wrapped  # during the fit, the instance's own convert_input took the index
    assert "convert_input" not in vars(seen.plugin)  # after it, its class's again
    assert cache._taker.taken is None


def test_a_batch_without_an_index_passes_the_taker_as_it_is() -> None:
    class Plugin:
        def convert_input(self, batch: Any) -> Any:
            return batch

    plugin, taker = Plugin(), IndexTaker()
    taker.attach(plugin)
    batch = {"x": torch.zeros(2)}
    assert plugin.convert_input(batch) is batch  # a validation batch, a batch read again
    assert taker.take() is None
    dict_batch = {"x": torch.zeros(2), INDEX_FIELD: SampleIndex([4, 1])}
    assert plugin.convert_input(dict_batch) is dict_batch
    assert list(dict_batch) == ["x"]
    taken = taker.take()
    assert taken is not None
    assert taken.indices == [4, 1]
    taker.attach(plugin)  # attached twice: one wrapper, and detach restores the class's
    taker.detach()
    assert "convert_input" not in vars(plugin)
