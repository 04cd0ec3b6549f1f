"""FrozenFeatureCache on the linear probe of a convolutional backbone with batch norm, the
recipe torchvision and timm users run: backbone frozen, put in eval mode in
``on_train_epoch_start``, a trainable head, a shuffled loader.

Two faults a new user found there: naming the backbone was refused (it is in train mode
when the cache is made, before the model's hook puts it in eval), and ``modules="auto"``
changed the losses' last bits (the step that found the backbone was not stored, so its
samples later ran one to three at a time, which a convolution computes otherwise).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit.compute.frozen_feature_cache import FrozenFeatureCache
from tests.helpers.one_thread import one_intra_op_thread  # noqa: F401 (autouse)

from .test_frozen_newuser_common import fit, same_losses


class Backbone(nn.Module):
    """A ResNet-style stem: convolutions, batch norm, pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.features(images)


class LinearProbe(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone().requires_grad_(False)
        self.head = nn.Linear(16, 10)
        self.losses: list[torch.Tensor] = []

    def on_train_epoch_start(self) -> None:
        self.backbone.eval()  # after Lightning's model.train(): running statistics, no update

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.head(self.backbone(images)), labels)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def _loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(48, 3, 16, 16, generator=generator)
    labels = torch.randint(0, 10, (48,), generator=generator)
    return DataLoader(TensorDataset(images, labels), batch_size=8, shuffle=True)


@pytest.mark.parametrize("modules", ["auto", ["backbone"]], ids=["auto", "named"])
def test_a_linear_probe_with_batch_norm_trains_bit_for_bit_as_without_the_cache(
    modules: Any,
) -> None:
    plain = fit(LinearProbe, _loader, None)
    cache = FrozenFeatureCache(modules=modules)
    cached = fit(LinearProbe, _loader, cache)
    assert same_losses(plain, cached, 18)
    counts = cache.counts
    assert (counts["stored"], counts["plain_calls"], counts["stood_down"]) == (48, 0, {})
    assert counts["hits"] == 2 * 48 - 8  # epochs 2 and 3, but the batch that checks
