"""Several train loaders at once: what a training step holds from each of them.

``trainer.fit(model, {"a": loader_a, "b": loader_b})`` (or a list of loaders, or a
``CombinedLoader``) trains each step on what Lightning's ``CombinedLoader`` yields, in
its mode (``"max_size_cycle"`` unless the user built the CombinedLoader with another):

- ``"max_size_cycle"``: a dict (or list) with one batch of every loader; a loader that
  runs out starts over, until the longest has run out.
- ``"min_size"``: one batch of every loader, until the shortest has run out.
- ``"max_size"``: one batch of every loader until the longest has run out; a loader
  that has run out gives None, so later steps hold fewer samples.
- ``"sequential"``: one loader's batch a step, each loader in turn (``fit`` refuses it in
  Lightning 2.6; evaluation loops use it).

A step's samples are those of every loader's batch in it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import lightning as L
from lightning.pytorch.utilities import CombinedLoader

from lightning_speedkit import _compat

#: The mode ``fit`` combines a dict or list of train loaders in, unless told otherwise.
DEFAULT_MODE = "max_size_cycle"


def _is_collection(value: Any) -> bool:
    return isinstance(value, (Mapping, list, tuple))


def _leaves(loaders: Any) -> Iterator[Any]:
    if isinstance(loaders, Mapping):
        for value in loaders.values():
            yield from _leaves(value)
    elif isinstance(loaders, (list, tuple)):
        for value in loaders:
            yield from _leaves(value)
    else:
        yield loaders


def _paired(loaders: Any, batch: Any) -> Iterator[Any]:
    """Each loader's batch in ``batch``, which mirrors the loaders' dicts and lists."""
    if isinstance(loaders, Mapping) and isinstance(batch, Mapping):
        for key, value in loaders.items():
            yield from _paired(value, batch.get(key))
    elif isinstance(loaders, (list, tuple)) and isinstance(batch, (list, tuple)):
        for value, part in zip(loaders, batch, strict=False):
            yield from _paired(value, part)
    else:
        yield batch


@dataclass(frozen=True)
class TrainLoaders:
    """The train loaders of a fit, as given (one, or dicts and lists of them), and the
    mode Lightning combines them in."""

    loaders: Any
    mode: str = DEFAULT_MODE

    @property
    def combined(self) -> bool:
        """Whether a step's batch holds one batch per loader (a dict or a list of them)."""
        return self.mode != "sequential" and _is_collection(self.loaders)

    def flat(self) -> list[Any]:
        """Every loader, in order."""
        return list(_leaves(self.loaders))

    def parts(self, batch: Any) -> list[Any]:
        """The batch of each loader in a step's ``batch``; a loader that has run out (None,
        in ``"max_size"`` mode) is left out."""
        if not self.combined:
            return [batch]
        return [part for part in _paired(self.loaders, batch) if part is not None]


def given(loaders: Any) -> TrainLoaders:
    """What a loader, dict or list of loaders, or CombinedLoader passed to ``fit`` trains on."""
    if isinstance(loaders, CombinedLoader):
        return TrainLoaders(loaders.iterables, _compat.combined_loader_mode(loaders))
    return TrainLoaders(loaders)


def of_trainer(trainer: L.Trainer) -> TrainLoaders | None:
    """The fit loop's train loaders and their mode; None before the loop has built them."""
    combined = _compat.train_combined_loader(trainer)
    if combined is None:
        return None
    return TrainLoaders(combined.iterables, _compat.combined_loader_mode(combined))


def loader_batch_size(loader: Any) -> int | None:
    """The batch size one loader promises (its own, or its batch sampler's), if it says."""
    for source in (loader, getattr(loader, "batch_sampler", None)):
        size = getattr(source, "batch_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return None
