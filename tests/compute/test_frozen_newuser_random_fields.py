"""FrozenFeatureCache on data a diffusion or captioning user has: a field drawn at random.

A dataset that picks one of several captions with torch's generator (while the image the
frozen tower reads is fixed) is common. The cache reads a few samples when the fit starts
to tell datasets apart; those reads drew from the run's generators (every later loss of a
seeded run differed from the plain run's), and the drawn caption changed the dataset's
fingerprint at every fit, so a second fit on a ``directory`` never started warm.

Also: a module named to cache whose forward never runs (diffusers' VAE, called as
``vae.encode(x)``) is said, with the submodule to name instead; and a module whose
forward samples (a posterior, with noise too small for ``verify`` to see) is never served.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit.compute._frozen_core import cache_frozen_features
from lightning_speedkit.compute._frozen_loader import dataset_fingerprint
from lightning_speedkit.compute.frozen_feature_cache import FrozenFeatureCache

from .test_frozen_newuser_common import Tower, fit, same_losses


class Captioned(Dataset[dict[str, torch.Tensor]]):
    """A fixed picture per index and one of three captions drawn with torch's generator."""

    def __init__(self, size: int = 24, offset: int = 0) -> None:
        self.size, self.offset = size, offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(int(index) + self.offset)
        captions = torch.randint(0, 10, (3, 4), generator=g)
        return {"pixels": torch.rand(3, 8, 8, generator=g),
                "caption": captions[torch.randint(0, 3, ()).item()]}  # fmt: skip


class Denoiser(L.LightningModule):
    """A frozen encoder, then noise drawn in the step (as latent diffusion draws it)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Tower().requires_grad_(False)
        self.text = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 8)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        latents = self.encoder(batch["pixels"])
        noise = torch.randn_like(latents)
        guess = self.head(latents + noise + self.text(batch["caption"]).mean(1))
        loss = F.mse_loss(guess, noise)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader[Any]:
    return DataLoader(Captioned(), batch_size=6, shuffle=True)


@pytest.mark.parametrize("modules", ["auto", ["encoder"]])
def test_the_cache_draws_no_number_of_the_runs(modules: Any) -> None:
    # Before: 3 samples read at the fit's start drew 3 captions: every loss differed.
    plain = fit(Denoiser, _loader, None)
    cache = FrozenFeatureCache(modules=modules)
    cached = fit(Denoiser, _loader, cache)
    assert same_losses(plain, cached, 12)
    assert cache.counts["hits"] > 0


def test_a_field_drawn_at_random_changes_no_fingerprint_and_draws_nothing() -> None:
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    first = dataset_fingerprint(Captioned())
    torch.manual_seed(99)  # another run: other captions drawn
    assert dataset_fingerprint(Captioned()) == first
    assert dataset_fingerprint(Captioned(offset=1)) != first  # other pictures: another dataset
    torch.manual_seed(3)
    assert torch.equal(torch.get_rng_state(), states[0])
    assert random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])


class OwnCounter(Captioned):
    """A caption that changes at every read, from the dataset's own state, not a seed."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.reads += 1
        return {**super().__getitem__(index), "caption": torch.tensor([self.reads % 4])}


def test_a_field_two_reads_disagree_on_is_left_out_whatever_draws_it() -> None:
    data = OwnCounter()
    first = dataset_fingerprint(data)  # reads 1-6
    assert dataset_fingerprint(data) == first  # reads 7-12: other captions at each probe


def test_the_fingerprint_seeds_the_cpu_generator_only() -> None:
    """``torch.manual_seed`` would also seed a CUDA generator not yet initialised (seeded
    lazily), which the random state kept cannot put back."""
    from unittest import mock

    with mock.patch.object(torch, "manual_seed", wraps=torch.manual_seed) as every_device:
        dataset_fingerprint(Captioned())
    assert every_device.call_count == 0


def test_a_second_fit_with_other_captions_starts_warm_from_the_directory(tmp_path: Path) -> None:
    def run(seed: int) -> tuple[Denoiser, FrozenFeatureCache]:
        cache = FrozenFeatureCache(modules=["encoder"], directory=tmp_path, budget=0)
        torch.manual_seed(0)  # the same frozen weights
        model = Denoiser()
        L.seed_everything(seed, verbose=False)  # another run: other captions, noise, order
        L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False,
                  callbacks=[cache]).fit(model, _loader())  # fmt: skip
        return model, cache

    first, _ = run(0)
    assert first.encoder.rows == [6] * 4  # cold: every sample run
    # Before: the drawn captions made another fingerprint, a new folder, and a cold fit.
    second, cache = run(1)
    assert second.encoder.rows == [6]  # the first reuse is checked; the rest served
    assert cache.counts["hits"] == 18
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == 1


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.conv(images).flatten(1)


class AutoencoderKL(nn.Module):
    """diffusers' VAE as a training script calls it: ``vae.encode(x)``, never ``vae(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = Encoder(), nn.Linear(36, 8)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return self.encoder(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encode(images))


class LatentDenoiser(Denoiser):
    def __init__(self) -> None:
        super().__init__()
        self.vae = AutoencoderKL().requires_grad_(False)
        self.head = nn.Linear(36, 36)
        self.text = nn.Embedding(10, 36)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        latents = self.vae.encode(batch["pixels"])
        noise = torch.randn_like(latents)
        loss = F.mse_loss(self.head(latents + noise + self.text(batch["caption"]).mean(1)), noise)
        self.losses.append(loss.detach().clone())
        return loss


def test_a_named_module_whose_forward_never_runs_is_said_with_the_one_to_name() -> None:
    cache = FrozenFeatureCache(modules=["vae"])
    with pytest.warns(UserWarning, match=r"`vae`.s forward did not run .* but `vae.encoder` of it"):
        fit(LatentDenoiser, _loader, cache, epochs=1)
    assert cache.counts["hits"] + cache.counts["misses"] == 0
    named = FrozenFeatureCache(modules=["vae.encoder"])  # the fix the warning names
    fit(LatentDenoiser, _loader, named, epochs=2)
    assert named.counts["hits"] > 0


@pytest.mark.parametrize("modules", ["auto", ["encoder"]])
def test_speed_monitor_takes_the_served_encoder_off_when_auto_found_it(modules: Any) -> None:
    # "auto" finds the encoder in the one step SpeedMonitor counts (every batch has one
    # shape here), before it is cached: its cost is measured as it is found. Before, it was
    # never known, and every served row was counted as run.
    from lightning_speedkit import SpeedMonitor, count_flops

    plain_monitor = SpeedMonitor(warmup_steps=0, log_every_n_steps=4)  # one figure an epoch
    plain = fit(Denoiser, _loader, None, extra=(plain_monitor,))
    monitor = SpeedMonitor(warmup_steps=0, log_every_n_steps=4)
    fit(Denoiser, _loader, FrozenFeatureCache(modules=modules), extra=(monitor,))
    encoder = count_flops(plain.encoder, torch.zeros(6, 3, 8, 8)).model / 6
    whole = plain_monitor.last_metrics["flops_per_sample"]
    # Epoch 3 is served whole: its steps spent the model's FLOPs less the encoder's.
    assert monitor.last_metrics["flops_per_sample"] == pytest.approx(whole - encoder, rel=1e-9)
    assert encoder > 0.5 * whole


class Flipped(Captioned):
    """The picture flipped at random (torch's generator, p=0.5), as a torchvision
    ``RandomHorizontalFlip`` in the dataset's transform does it."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = super().__getitem__(index)
        if torch.rand(()) < 0.5:
            sample["pixels"] = sample["pixels"].flip(-1)
        return sample


def test_an_input_two_reads_disagree_on_is_never_stored_or_served() -> None:
    """The fingerprint's two reads of a sample already show the tower's input is drawn:
    the cache stands down at the first call, before storing anything. Before, it stored
    the first epoch and only ``verify`` on the first reuse caught it (and a rare
    augmentation can pass that one batch)."""
    plain = fit(Denoiser, lambda: DataLoader(Flipped(), batch_size=6, shuffle=True), None)
    cache = FrozenFeatureCache(modules=["encoder"])
    with pytest.warns(UserWarning, match=r"`encoder`: its input, the batch's `pixels`, differed"):
        cached = fit(Denoiser, lambda: DataLoader(Flipped(), batch_size=6, shuffle=True), cache)
    assert same_losses(plain, cached, 12)
    counts = cache.counts
    assert (counts["stored"], counts["hits"]) == (0, 0)
    assert "differed between two reads" in counts["stood_down"]["encoder"]


def test_the_fields_two_reads_disagree_on_are_named() -> None:
    drawn: set[Any] = set()
    dataset_fingerprint(Flipped(), drawn=drawn)
    assert drawn == {"pixels", "caption"}
    drawn.clear()
    dataset_fingerprint(Captioned(), drawn=drawn)
    assert drawn == {"caption"}  # the tower's input is fixed: it may be cached


class Posterior(nn.Module):
    """A user's wrapper of a VAE that samples its posterior in its forward, as
    ``vae.encode(x).latent_dist.sample()`` does: ``encoder`` computes the mean, and a
    trained VAE's posterior is nearly deterministic (its noise is far below ``verify``'s
    tolerance, which therefore passes)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Tower()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        mean = self.encoder(images)
        return mean + torch.randn_like(mean) * 1e-6


class SampledDenoiser(Denoiser):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Posterior().requires_grad_(False)  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("modules", "said", "runs"),
    [
        # named: stood down at its first call, before anything is stored; runs every step
        (["encoder"], "stopped serving `encoder`", [6] * 12),
        # "auto": left out, and the mean's encoder inside it, which draws nothing, served
        # (epoch 1 runs it, epoch 2's first batch checks it)
        ("auto", "leaves `encoder` out", [6] * 5),
    ],
)
def test_a_forward_that_samples_is_never_served_and_draws_as_the_plain_run(
    modules: Any, said: str, runs: list[int]
) -> None:
    # Before: stored, verified (the noise is within 1e-4) and served from epoch 2; the
    # served calls drew no noise, so the step's own `randn_like` drew other numbers and
    # every later loss differed from the plain run's, with no warning.
    plain = fit(SampledDenoiser, _loader, None)
    cache = FrozenFeatureCache(modules=modules)
    said += r": its forward draws random numbers \(from torch's CPU generator\).*vae.encoder"
    with pytest.warns(UserWarning, match=said):
        cached = fit(SampledDenoiser, _loader, cache)
    assert same_losses(plain, cached, 12)
    assert plain.encoder.encoder.rows == [6] * 12
    assert cached.encoder.encoder.rows == runs
    counts = cache.counts
    if modules == "auto":
        assert list(cache.cache.modules) == ["encoder.encoder"]  # type: ignore[union-attr]
        assert (counts["hits"], counts["stood_down"]) == (18 + 24, {})
    else:
        assert (counts["stored"], counts["hits"]) == (0, 0)
        assert "draws random numbers" in counts["stood_down"]["encoder"]


class OwnNoise(nn.Module):
    """A frozen layer that adds noise from a generator it holds, or one it is given."""

    def __init__(self, hold: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 4).requires_grad_(False)
        self.generator = torch.Generator().manual_seed(0) if hold else None

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        mean = self.proj(x)
        noise = torch.randn(mean.shape, generator=generator or self.generator)
        return mean + noise * 1e-6


@pytest.mark.parametrize("hold", [True, False])
def test_a_forward_drawing_from_its_own_generator_is_never_served(hold: bool) -> None:
    def run(cached: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)  # the same weights
        holder = nn.Module()
        holder.noise = OwnNoise(hold)
        cache = cache_frozen_features(holder, ["noise"]) if cached else None
        given = {} if hold else {"generator": torch.Generator().manual_seed(0)}
        x, outs = torch.randn(4, 3, generator=torch.Generator().manual_seed(1)), []
        for _ in range(3):
            with cache.keys(range(4)) if cache is not None else contextlib.nullcontext():
                outs.append(holder.noise(x, **given))
        if cache is not None:
            assert cache.counts()["hits"] == 0
            assert "draws random numbers" in cache.counts()["stood_down"]["noise"]
        return outs

    plain = run(False)
    said = "the generator `generator`" if hold else "the generator passed as `generator`"
    with pytest.warns(UserWarning, match=rf"`noise`: its forward draws .*\(from {said}\)"):
        cached = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, cached, strict=True))
    assert not torch.equal(plain[0], plain[1])  # each call drew new noise
