"""FrozenFeatureCache beside the kit's other levers, as a user would stack them.

On the example VLM with its tower frozen: AttentionSwap, ActivationCheckpointing,
RegionalCompile (``aot_eager``: dynamo and AOTAutograd as for inductor, without the C++
build) and SpeedMonitor. On a small classifier: a SpeedDataModuleMixin datamodule with
length bucketing and its sample cache, and NumWorkersTuner rebuilding the train loader.
Each run is compared, loss for loss and bit for bit, with the same stack without the cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_speedkit import (
    ActivationCheckpointing,
    AttentionSwap,
    NumWorkersTuner,
    RegionalCompile,
    SpeedDataModuleMixin,
    SpeedMonitor,
)
from lightning_speedkit.compute.frozen_feature_cache import FrozenFeatureCache

from .test_frozen_feature_cache import _fit
from .test_frozen_newuser_common import fit, same_losses
from .test_frozen_newuser_data import CaptionClassifier, Captioned


def _levers(compile: bool) -> tuple[L.Callback, ...]:
    if compile:  # not with checkpointing: dynamo refuses the decoder's dropout in a recompute
        return (RegionalCompile(backend="aot_eager", verbose=False),)
    return (
        AttentionSwap(backend="sdpa", measure=False, verbose=False),
        ActivationCheckpointing(verbose=False),
        SpeedMonitor(warmup_steps=0, log_every_n_steps=6),
    )


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, True], ids=["swap-checkpoint-monitor", "compile"])
def test_with_the_kits_other_levers(small_corpus: Path, compile: bool) -> None:
    _, plain, _ = _fit(small_corpus, 2, None, extra=_levers(compile))
    cache = FrozenFeatureCache(modules=["model.vision"])
    _, cached, runs = _fit(small_corpus, 2, cache, extra=_levers(compile))
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, cached.losses, strict=True))
    assert len(cached.losses) == 12
    assert runs == [16] * 7  # epoch 1, and epoch 2's check: the rest served
    assert (cache.counts["hits"], cache.counts["stood_down"]) == (80, {})


class Bucketed(SpeedDataModuleMixin, L.LightningDataModule):
    """Length-bucketed batches of the captioned pictures, samples kept after a first read."""

    def train_dataloader(self) -> DataLoader[Any]:
        data = Captioned()
        lengths = [1 + i % 5 for i in range(len(data))]
        return self.speed_dataloader(data, batch_size=6, shuffle=True, lengths=lengths, cache=True)


class Trained(CaptionClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.data = Bucketed()

    def train_dataloader(self) -> DataLoader[Any]:
        return self.data.train_dataloader()


def test_with_the_mixins_bucketing_and_sample_cache_and_num_workers_tuner() -> None:
    def tuner() -> NumWorkersTuner:
        return NumWorkersTuner(max_workers=1, batches=2, warmup_batches=1, cache=False,
                               progress=False, verdict_steps=0)  # fmt: skip

    plain = fit(Trained, lambda: (), None, extra=(tuner(),))
    steps = len(plain.losses)  # buckets: some batches hold fewer than 6
    for key in ("id", "index"):  # a field of the batch; the index carried through it all
        cache = FrozenFeatureCache(modules=["tower"], key=key)
        cached = fit(Trained, lambda: (), cache, extra=(tuner(),))
        assert same_losses(plain, cached, steps)
        counts = cache.counts
        # epoch 1 runs all 24, epoch 2 checks its first batch (it runs), the rest is served
        assert counts["misses"] == sum(cached.tower.rows) == 24 + cached.tower.rows[-1]
        assert counts["hits"] == 72 - counts["misses"]
