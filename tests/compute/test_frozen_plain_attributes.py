"""FrozenFeatureCache and a frozen module's plain Python attributes: a public setting its
forward reads (a temperature changed by a hook) is part of a feature's key, seen as each
epoch starts; state the key cannot hold is named by ``verify``'s warning."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit.compute._frozen_core import cache_frozen_features
from lightning_speedkit.compute._frozen_modules import fingerprint, plain_attributes
from lightning_speedkit.compute.frozen_feature_cache import FrozenFeatureCache

SAMPLES, BATCH, EPOCHS = 32, 8, 4


class _Samples(Dataset[Any]):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x = torch.randn(12, generator=torch.Generator().manual_seed(index))
        return {"x": x, "y": torch.tensor(index % 2)}


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 8)
        self.temperature = 1.0  # a plain attribute, not a buffer
        self.calls: list[int] = []  # what it saw: not a setting, never part of the key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(len(x))
        return torch.tanh(self.proj(x) / self.temperature)


class _Task(L.LightningModule):
    """A frozen tower whose temperature a hook changes as epoch 2 starts."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tower = _Tower().requires_grad_(False)
        self.head = nn.Linear(8, 2)
        self.losses: list[torch.Tensor] = []

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 2:
            self.tower.temperature = 3.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self.head(self.tower(batch["x"])), batch["y"])
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def _fit(callbacks: list[L.Callback]) -> _Task:
    L.seed_everything(0, verbose=False)
    task = _Task()
    L.Trainer(
        max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    ).fit(task, DataLoader(_Samples(), batch_size=BATCH, shuffle=True))  # fmt: skip
    return task


def test_a_temperature_changed_by_a_hook_is_computed_again_not_served_stale() -> None:
    plain = _fit([])
    cache = FrozenFeatureCache(modules=["tower"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cached = _fit([cache])
    assert len(cached.losses) == len(plain.losses) == EPOCHS * SAMPLES // BATCH
    assert all(torch.equal(a, b) for a, b in zip(cached.losses, plain.losses, strict=True))
    counts = cache.counts
    # Epoch 0 stores; epoch 1 verifies its first batch and serves the rest; epoch 2 (the
    # new temperature) runs and stores again; epoch 3 serves.
    assert counts["misses"] == SAMPLES + BATCH + SAMPLES
    assert counts["hits"] == SAMPLES - BATCH + SAMPLES
    assert counts["stood_down"] == {}
    said = [str(w.message) for w in caught if "computes `tower`'s features again" in str(w.message)]
    assert len(said) == 1
    assert "`temperature`" in said[0]
    assert "calls" not in said[0]


def test_plain_attributes_hold_settings_not_what_a_module_collects() -> None:
    tower = _Tower()
    tower._private = 2.0
    tower.config = object()
    tower.scale = torch.tensor(2.0)  # a tensor that is not a buffer
    assert plain_attributes(tower) == {
        "temperature": "1.0",
        "proj.in_features": "12",
        "proj.out_features": "8",
    }
    before = fingerprint(tower)
    tower.calls.append(4)
    tower.train(False)
    assert fingerprint(tower) == before  # what it saw and its mode are not settings
    tower.temperature = 2.0
    assert fingerprint(tower) != before


def test_verify_names_state_the_key_does_not_hold_beside_an_augmentation() -> None:
    """A private attribute changed between epochs is not in the key: the first reuse finds
    the features differ, and the warning names both likely causes."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(12, 8)
            self._scale = 1.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x) * self._scale

    model = nn.Sequential(Scaled().requires_grad_(False), nn.Linear(8, 2))
    cache = cache_frozen_features(model, modules=["0"])
    x = torch.randn(4, 12)
    with cache.keys(range(4)):
        model(x)
    model[0]._scale = 2.0
    cache.recheck_weights()  # as each epoch starts: the key cannot see a private attribute
    augmentation = "random augmentation of its input"
    with pytest.warns(UserWarning, match=augmentation) as record, cache.keys(range(4)):
        out = model(x)
    assert torch.equal(out, model[1](model[0].proj(x) * 2.0))  # computed, not served
    message = str(record[0].message)
    assert "state its forward reads that a feature's key does not hold" in message
    assert "register such state as a buffer" in message
    assert list(cache.counts()["stood_down"]) == ["0"]
