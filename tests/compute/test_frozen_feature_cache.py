"""FrozenFeatureCache in a Trainer: the same losses, bit for bit, and the tower really skipped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_speedkit.compute._frozen_loader import INDEX_FIELD
from lightning_speedkit.compute.frozen_feature_cache import FrozenFeatureCache
from lightning_speedkit.errors import SpeedkitConfigError
from speedkit_examples.vlm import VLMConfig, VLMDataModule, VLMTask
from tests.conftest import SMALL_CORPUS

ROW = 16 * 64 * 4  # a sample's features: 16 image tokens x 64 wide, float32


class _Losses(Callback):
    """Every training loss, and the keys of each batch the model saw."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.fields: list[list[str]] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(outputs["loss"].detach().clone())
        self.fields.append(sorted(batch))


def _tower_runs(task: VLMTask) -> list[int]:
    """Samples the tower's first layer ran on, appended per call."""
    rows: list[int] = []
    task.model.vision.patch_embed.register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0]))
    return rows


def _fit(
    data_dir: Path,
    epochs: int,
    cache: FrozenFeatureCache | None,
    *,
    seed: int = 0,
    task: VLMTask | None = None,
    extra: tuple[Callback, ...] = (),
    workers: int = 0,
    ckpt_path: Path | None = None,
) -> tuple[VLMTask, _Losses, list[int]]:
    L.seed_everything(seed, verbose=False)
    data = VLMDataModule(
        data_dir, batch_size=16, corpus=SMALL_CORPUS, progress=False, num_workers=workers
    )
    cfg = VLMConfig.preset("tiny", data.tokenizer.vocab_size, freeze_vision=True)
    task = task or VLMTask(cfg, pad_id=data.tokenizer.pad_id)
    runs = _tower_runs(task)
    losses = _Losses()
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in extra),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[losses, *extra, *([cache] if cache else [])],
    )
    trainer.fit(task, datamodule=data, ckpt_path=ckpt_path)
    return task, losses, runs


@pytest.mark.parametrize("modules", ["auto", ["model.vision"]])
def test_losses_are_bitwise_the_plain_runs_and_the_tower_skips_served_samples(
    small_corpus: Path, modules: Any
) -> None:
    _, plain, plain_runs = _fit(small_corpus, 3, None)
    cache = FrozenFeatureCache(modules=modules)
    task, cached, runs = _fit(small_corpus, 3, cache)
    assert len(plain.losses) == len(cached.losses) == 18  # 96 samples / 16, 3 epochs
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, cached.losses, strict=True))
    assert all(INDEX_FIELD not in fields for fields in cached.fields)  # the model never sees it
    assert plain_runs == [16] * 18
    counts = cache.counts
    if modules == "auto":  # found on batch 1, whose features are stored as it ran
        assert list(cache.cache.modules) == ["model.vision"]  # type: ignore[union-attr]
    # epoch 1 runs and stores 96; epoch 2's first batch verifies (runs 16); 80 + 96 served.
    # ("auto" once left batch 1 unstored: epoch 2 ran its samples a few rows at a time.)
    assert (counts["misses"], counts["hits"], counts["stored"]) == (112, 176, 96)
    assert runs == [16] * 7
    assert counts["store_bytes"] == 96 * 16 * 64 * 4  # 16 image tokens x 64 wide, float32
    assert counts["stood_down"] == {}
    assert "forward" not in vars(task.model.vision)  # taken off after the fit


def test_a_second_fit_starts_warm_and_changed_weights_miss(small_corpus: Path) -> None:
    cache = FrozenFeatureCache(modules=["model.vision"], verify=False)
    task, _, runs = _fit(small_corpus, 1, cache)
    assert cache.counts["misses"] == 96
    _, _, runs = _fit(small_corpus, 1, cache, task=task)
    assert runs == []
    assert cache.counts["hits"] == 96
    with torch.no_grad():
        task.model.vision.norm.bias.add_(0.5)
    _, _, runs = _fit(small_corpus, 1, cache, task=task)
    assert runs == [16] * 6
    assert cache.counts["misses"] == 192
    assert cache.counts["stored"] == 192
    assert cache.counts["store_bytes"] == 96 * 16 * 64 * 4


def test_a_new_cache_with_the_same_directory_starts_warm_with_the_plain_losses(
    small_corpus: Path, tmp_path: Path
) -> None:
    _, plain, _ = _fit(small_corpus, 2, None)
    first = FrozenFeatureCache(modules=["model.vision"], directory=tmp_path)
    _fit(small_corpus, 1, first)
    (shard,) = tmp_path.rglob("*.bin")  # epoch 1's 96 samples, written at its end
    assert shard.stat().st_size == first.counts["disk_bytes"] == 96 * ROW
    # a new model and a new cache, as a new process has them: only the folder is shared
    cache = FrozenFeatureCache(modules=["model.vision"], directory=tmp_path, budget=0)
    _, cached, runs = _fit(small_corpus, 2, cache)
    assert runs == [16]  # the first batch runs once, to check the features read back
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, cached.losses, strict=True))
    counts = cache.counts
    assert (counts["hits"], counts["misses"], counts["stored"]) == (176, 16, 0)
    assert (counts["store_bytes"], counts["disk_bytes"]) == (0, 96 * ROW)
    assert len(list(tmp_path.rglob("*.bin"))) == 1  # nothing written twice


def test_a_resumed_fit_with_the_same_directory_starts_warm(
    small_corpus: Path, tmp_path: Path
) -> None:
    checkpoints = ModelCheckpoint(tmp_path / "ckpt", save_top_k=-1)
    first = FrozenFeatureCache(modules=["model.vision"], directory=tmp_path / "features")
    _fit(small_corpus, 1, first, extra=(checkpoints,))
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")
    cache = FrozenFeatureCache(modules=["model.vision"], directory=tmp_path / "features")
    _, _, runs = _fit(small_corpus, 2, cache, ckpt_path=checkpoint)
    # counters come from the checkpoint; the features from the folder: epoch 2 runs one
    # batch (to learn the output's structure; the check was done before) and serves 80
    assert runs == [16]
    assert cache.state_dict()["model.vision"]["hits"] == 80
    assert cache.state_dict()["model.vision"]["misses"] == 96 + 16
    assert cache.counts["disk_bytes"] == 96 * ROW


def test_budget_stops_storing_and_the_rest_runs(small_corpus: Path) -> None:
    row = 16 * 64 * 4
    cache = FrozenFeatureCache(modules=["model.vision"], budget=40 * row, verify=False)
    _, _, runs = _fit(small_corpus, 2, cache)
    counts = cache.counts
    assert counts["stored"] == 40
    assert counts["store_bytes"] == 40 * row
    assert counts["hits"] == 40
    assert counts["misses"] == 96 + 56
    assert sum(runs) == 96 + 56


def test_state_dict_holds_counters_not_features(small_corpus: Path) -> None:
    cache = FrozenFeatureCache(modules=["model.vision"], verify=False)
    _fit(small_corpus, 2, cache)
    state = cache.state_dict()
    assert state == {
        "model.vision": {
            "hits": 96,
            "misses": 96,
            "stored": 96,
            "not_stored": 0,
            "plain_calls": 0,
            "refetched": 0,
            "verified": False,
            "stood_down": None,
        }
    }
    fresh = FrozenFeatureCache(modules=["model.vision"])
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


def test_a_missing_key_field_names_the_fix(small_corpus: Path) -> None:
    with pytest.raises(SpeedkitConfigError, match=r"^`key` is not a field of the batch.*'images'"):
        _fit(small_corpus, 1, FrozenFeatureCache(modules=["model.vision"], key="sample_id"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"directory": 7}, "`directory` must be a path or None"),
        ({"directory": __file__}, "`directory` is a file"),
        ({"budget": "half"}, "`budget` must be a number of bytes or a share"),
        ({"budget": "150%"}, "`budget` must be a number of bytes or a share"),
        ({"dtype": "int8"}, "`dtype` is not one of the choices"),
        ({"verify": "yes"}, "`verify` must be True or False"),
        ({"key": ""}, "`key` must be a non-empty string"),
        # these three were accepted until the fit started
        ({"dtype": torch.int8}, "`dtype` must be a floating torch.dtype or None, got torch.int8"),
        ({"dtype": 5}, "`dtype` must be a floating torch.dtype or None, got 5"),
        ({"modules": 5}, "`modules` must be 'auto', a submodule name or an nn.Module type"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SpeedkitConfigError, match=message):
        FrozenFeatureCache(**kwargs)


def test_a_module_name_that_does_not_exist_is_refused_at_setup(small_corpus: Path) -> None:
    with pytest.raises(SpeedkitConfigError, match=r"`modules` is not a submodule.*'model.vision'"):
        _fit(small_corpus, 1, FrozenFeatureCache(modules=["vision"]))


def test_speed_monitor_counts_the_flops_that_ran_not_the_served_towers(
    small_corpus: Path,
) -> None:
    from lightning_speedkit import SpeedMonitor, count_flops

    plain_monitor = SpeedMonitor(warmup_steps=0, log_every_n_steps=6)
    task, _, _ = _fit(small_corpus, 3, None, extra=(plain_monitor,))
    monitor = SpeedMonitor(warmup_steps=0, log_every_n_steps=6)  # one figure per epoch
    cache = FrozenFeatureCache(modules=["model.vision"])
    _fit(small_corpus, 3, cache, extra=(monitor,))
    images = torch.zeros(16, 3, task.config.image_size, task.config.image_size)
    tower = count_flops(task.model.vision, images).model / 16
    plain = plain_monitor.last_metrics["flops_per_sample"]
    # Epoch 3 is served whole: its steps spent the model's FLOPs less the tower's.
    assert monitor.last_metrics["flops_per_sample"] == pytest.approx(plain - tower, rel=1e-9)
    assert tower > 0.05 * plain  # the check means something: the tower is a real share
