"""SpeedMonitor on several train loaders at once (Lightning's CombinedLoader, in each mode).

Every timed step's samples are counted on a virtual clock, so the throughput is exact:
a step trains every loader's batch, and ``samples_per_sec`` must count them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities import CombinedLoader

from lightning_speedkit import SpeedMonitor
from lightning_speedkit.measure import _clock
from tests.helpers.clock import VirtualClock

from ..helpers import models
from ..helpers.models import MLP, loader

STEP = 0.02  # virtual seconds per training step


class CombinedMLP(MLP):
    """MLP trained on every loader's batch of a step (a dict or a list of them); one
    ``step_delay`` a step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.step_delay:
            models._sleep(self.step_delay)
        parts = list(batch.values()) if isinstance(batch, Mapping) else list(batch)
        losses = [(self.net(x) - x).pow(2).mean() for x in parts if x is not None]
        return torch.stack(losses).sum()


@pytest.fixture
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    clock = VirtualClock()
    monkeypatch.setattr(_clock, "_host_time", clock)
    monkeypatch.setattr(models, "_sleep", clock.sleep)
    return clock


def _fit(model: L.LightningModule, monitor: SpeedMonitor, loaders: Any, **kw: Any) -> None:
    trainer = L.Trainer(
        accelerator="cpu", logger=False, callbacks=[monitor], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=50, **kw,
    )  # fmt: skip
    trainer.fit(model, loaders)


def _two(kind: str, first: Any, second: Any) -> Any:
    return {"a": first, "b": second} if kind == "dict" else [first, second]


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_every_loader_of_a_step_is_counted(kind: str, virtual_clock: VirtualClock) -> None:
    # 8 + 4 samples a step, 20 ms a step: 600 samples/s, not the first loader's 400.
    monitor = SpeedMonitor(peak_flops=None)
    loaders = _two(kind, loader(n=128, batch_size=8), loader(n=64, batch_size=4))
    _fit(CombinedMLP(step_delay=STEP), monitor, loaders, max_steps=12)
    assert monitor.summary["samples_per_sec"] == pytest.approx(12 / STEP, rel=1e-12)


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_the_counted_flops_are_per_sample_of_every_loader(kind: str) -> None:
    model, monitor = CombinedMLP(), SpeedMonitor(peak_flops=1e12)
    loaders = _two(kind, loader(n=128, batch_size=8), loader(n=64, batch_size=4))
    _fit(model, monitor, loaders, max_steps=8)
    assert [c.samples for c in monitor.flops.counted.values()] == [12]
    assert monitor.summary["flops_per_sample"] == model.flops_per_sample()


# Loader "a": 4 batches of 8; loader "b": 2 batches of 4 ("sequential", one loader's batch
# a step, is a mode `fit` refuses). Steps are timed from the second
# on (the first has no previous end), warm-up off, no FLOP count (flops_per_batch given).
@pytest.mark.parametrize(
    ("mode", "timed_samples", "timed_steps"),
    [
        ("max_size_cycle", 3 * 12, 3),  # b cycles: every step has both
        ("min_size", 1 * 12, 1),  # stops with b: 2 steps
        ("max_size", 1 * 12 + 2 * 8, 3),  # b runs out: its entry is None
    ],
)
def test_each_combined_mode_counts_what_the_step_trained(
    mode: str, timed_samples: int, timed_steps: int, virtual_clock: VirtualClock
) -> None:
    monitor = SpeedMonitor(peak_flops=None, warmup_steps=0, flops_per_batch=lambda batch: 0)
    loaders = CombinedLoader(
        {"a": loader(n=32, batch_size=8), "b": loader(n=8, batch_size=4)}, mode=mode
    )
    _fit(CombinedMLP(step_delay=STEP), monitor, loaders, max_epochs=1)
    expected = timed_samples / (timed_steps * STEP)
    assert monitor.summary["samples_per_sec"] == pytest.approx(expected, rel=1e-12)


def test_tokens_are_summed_over_the_loaders(virtual_clock: VirtualClock) -> None:
    class Ids(torch.utils.data.Dataset[torch.Tensor]):
        def __init__(self, length: int) -> None:
            self.length = length

        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.zeros(self.length, dtype=torch.long)

    class Model(CombinedMLP):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            models._sleep(STEP)
            return self.net[0].weight.sum() * 0

    monitor = SpeedMonitor(peak_flops=None, flops_per_batch=lambda batch: 0)
    loaders = {
        "short": torch.utils.data.DataLoader(Ids(16), batch_size=8),  # 128 tokens a batch
        "long": torch.utils.data.DataLoader(Ids(24), batch_size=2),  # 48 tokens a batch
    }
    _fit(Model(), monitor, loaders, max_steps=8)
    assert monitor.summary["tokens_per_sec"] == pytest.approx(176 / STEP, rel=1e-12)
    assert monitor.summary["samples_per_sec"] == pytest.approx(10 / STEP, rel=1e-12)
