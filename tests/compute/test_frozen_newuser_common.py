"""What the new-user tests of FrozenFeatureCache share: a tiny frozen tower, a trainer, a
plain run beside a cached run from the same seed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_speedkit.compute.frozen_feature_cache import FrozenFeatureCache


class Tower(nn.Module):
    """A frozen image tower of any input size; ``rows`` logs the samples each real run saw."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(3)
        self.proj = nn.Linear(36, width)
        self.rows: list[int] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.rows.append(images.shape[0])
        return self.proj(self.pool(self.conv(images)).flatten(1))


def trainer(epochs: int, callbacks: list[Any], **options: Any) -> L.Trainer:
    settings: dict[str, Any] = {
        "max_epochs": epochs,
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    settings.update(options)
    return L.Trainer(callbacks=callbacks, **settings)


def fit(
    make_model: Callable[[], L.LightningModule],
    make_loader: Callable[[], Any],
    cache: FrozenFeatureCache | None,
    epochs: int = 3,
    extra: tuple[Any, ...] = (),
    **options: Any,
) -> Any:
    """``make_model()`` trained from seed 0 on ``make_loader()``, with ``cache`` if given."""
    L.seed_everything(0, verbose=False)
    model = make_model()
    callbacks = [*extra, *([cache] if cache is not None else [])]
    loaders = make_loader()  # a train loader, or (train, val)
    trainer(epochs, callbacks, **options).fit(
        model, *(loaders if isinstance(loaders, tuple) else (loaders,))
    )
    return model


def same_losses(plain: Any, cached: Any, steps: int) -> bool:
    """Both runs logged ``steps`` losses, bit for bit equal."""
    assert len(plain.losses) == len(cached.losses) == steps
    return all(torch.equal(a, b) for a, b in zip(plain.losses, cached.losses, strict=True))
