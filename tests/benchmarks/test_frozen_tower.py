"""The frozen-tower benchmark keeps working; its numbers are recorded in docs/frozen-features.md."""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.helpers.modules import load_module, load_on_small_corpus

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "frozen_tower.py"


def _run(module: ModuleType, corpus: Path, out: Path, model: str) -> dict:
    return module.main(["--data-dir", str(corpus), "--model", model, "--samples", "8",
                        "--batch-size", "4", "--epochs", "3", "--rounds", "1",
                        "--calls", "3", "--out", str(out)])  # fmt: skip


@pytest.mark.parametrize("model", ["vlm-tiny", "llava-tiny"])
def test_frozen_tower_runs_side_by_side_and_writes_its_table(
    model: str, small_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if model == "llava-tiny":
        pytest.importorskip("transformers")
    module = load_on_small_corpus(SCRIPT, monkeypatch)
    out = tmp_path / "frozen.json"
    report = _run(module, small_corpus, out, model)
    assert json.loads(out.read_text()) == report
    (row,) = report["rows"]
    assert row["model"] == model
    assert row["same_losses"] is True  # the cache changes no loss
    # epoch 0 runs 8 samples; epoch 1 verifies on batch 1 (4 run), serves batch 2; epoch 2
    # serves all 8; every served sample was built without its image
    assert (row["misses"], row["hits"]) == (12, 12)
    assert row["inputs_skipped"] == 12
    # float32 rows of 64: the VLM's tower gives 16 image tokens; Llava's CLIP tower its last
    # hidden state (16 patches and the class token), its pooled row, and the hidden state
    # Llava asks for (17 again; the ones it does not ask for are None)
    rows = 16 if model == "vlm-tiny" else 17 + 1 + 17
    assert row["store_bytes"] == 8 * rows * 64 * 4
    assert row["timed_epochs"] == 1
    assert row["ideal_speedup"] == pytest.approx(1 / (1 - row["tower_share"] - row["decode_share"]))
    assert row["speedup"] == pytest.approx(
        row["cached_samples_per_sec"] / row["plain_samples_per_sec"]
    )
    assert 0 < row["tower_share"] < 1
    assert 0 <= row["decode_share"] < 1
    assert row["tower_forward_us"] > 0  # timed: present, no threshold
    assert row["served_call_us"] > 0


def test_the_shares_are_the_tower_and_the_images_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_on_small_corpus(SCRIPT, monkeypatch)
    plain = {"seconds": 10.0, "tower_seconds": 2.0, "full_builds": (5.0, 100)}
    cached = {"bare_builds": (0.5, 50)}  # 10 ms a sample without its image
    tower, decode = module._shares(plain, cached)
    assert (tower, decode) == (0.2, pytest.approx(0.4))  # 5 s of builds less 100 x 10 ms
    assert module._shares(plain, {"bare_builds": (0.0, 0)}) == (0.2, 0.5)  # none built bare


def test_a_precision_reaches_the_fits_and_the_record_says_where_it_ran(
    small_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_on_small_corpus(SCRIPT, monkeypatch)
    fits: dict[str, list[dict]] = {"32-true": [], "bf16-mixed": []}
    fit = module._fit

    def kept(model: Any, dataset: Any, args: argparse.Namespace, cached: bool) -> dict:
        fits[args.precision].append(fit(model, dataset, args, cached))
        return fits[args.precision][-1]

    monkeypatch.setattr(module, "_fit", kept)
    before = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    for precision in fits:
        out = tmp_path / f"frozen_{precision}.json"
        report = module.main(["--data-dir", str(small_corpus), "--model", "vlm-tiny",
                              "--samples", "8", "--batch-size", "4", "--epochs", "3",
                              "--rounds", "1", "--calls", "3", "--accelerator", "cpu",
                              "--precision", precision, "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == report
    assert report["date"] in (before, datetime.now(timezone.utc).strftime("%Y-%m-%d"))
    assert (report["device"], report["torch"]) == ("cpu", torch.__version__)
    assert (report["precision"], report["complete"]) == ("bf16-mixed", True)
    (row,) = report["rows"]
    # every fit's rate as it ended (what a time limit would have kept), then the medians
    assert [(p["model"], p["round"], p["side"]) for p in report["progress"]] == [
        ("vlm-tiny", 0, "plain"), ("vlm-tiny", 0, "cached")]  # fmt: skip
    rates = [p["samples_per_sec"] for p in report["progress"]]
    assert rates == [row["plain_samples_per_sec"], row["cached_samples_per_sec"]]
    # served features are the ones the tower gave under autocast: the same losses, bitwise
    assert (row["same_losses"], row["loss_gap"]) == (True, 0.0)
    # the tower ends in a LayerNorm, which autocast runs in float32: float32 rows of 64
    assert (row["store_bytes"], row["disk_bytes"]) == (8 * 16 * 64 * 4, 0)
    # the Trainer trained in bf16: plain's losses are float32's, rounded a little
    plain32, plain16 = fits["32-true"][0]["losses"], fits["bf16-mixed"][0]["losses"]
    assert len(plain32) == len(plain16) == 6  # 3 epochs of 2 batches
    gaps = [abs(a - b) for a, b in zip(plain32, plain16, strict=True)]
    assert 0 < max(gaps) < 0.05


def test_vlm_base_is_the_example_base_preset_behind_a_frozen_tower() -> None:
    module = load_module(SCRIPT)
    tokenizer = module.CaptionTokenizer()
    model, config = module._vlm("vlm-base", tokenizer)
    assert config == module.VLMConfig.preset("base", tokenizer.vocab_size, freeze_vision=True)
    assert (config.image_size, config.vision_dim, config.text_dim) == (224, 768, 1024)
    assert (model.name, model.tower) == ("vlm-base", "model.vision")


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU where there is none")
def test_a_gpu_run_without_a_gpu_is_refused_before_it_starts(tmp_path: Path) -> None:
    module = load_module(SCRIPT)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--accelerator", "gpu", "--out", str(tmp_path / "frozen.json")])
    assert exit_.value.code == 2
    assert not (tmp_path / "frozen.json").exists()


class _Event:
    """torch.cuda.Event on a fake clock (ms): ``elapsed_time`` between two records."""

    clock = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = _Event.clock

    def elapsed_time(self, end: _Event) -> float:
        assert self.at is not None
        assert end.at is not None
        return end.at - self.at


class _Tower(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Event.clock += 4.0  # the device runs the tower for 4 ms
        return x


def test_on_cuda_the_epochs_span_syncs_and_the_tower_is_timed_by_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA clock on a CPU, torch.cuda's events and synchronize stood in for: the
    epoch waits for the device at its start and end only, the tower's forward is the sum
    of its events' times, and the losses are read after the epoch's span."""
    module = load_module(SCRIPT)
    syncs: list[int] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(1))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    task = torch.nn.Module()
    task.tower = _Tower()
    epochs = module._Epochs(1, "tower", [], cuda=True)
    trainer = argparse.Namespace(current_epoch=0)
    epochs.on_train_start(trainer, task)
    for epoch in (0, 1):  # warm-up, then timed
        trainer.current_epoch = epoch
        epochs.on_train_epoch_start(trainer, task)
        assert len(syncs) == 2 * epoch + 1
        for step in range(2):
            _Event.clock += 1.0  # the rest of the step
            task.tower(torch.ones(1))
            loss = torch.tensor(float(10 * epoch + step))
            epochs.on_train_batch_end(trainer, task, {"loss": loss}, None, step)
            assert epochs.losses == [0.0, 1.0] * epoch  # none read inside the epoch
        epochs.on_train_epoch_end(trainer, task)
    assert len(syncs) == 4  # each epoch's start and end, never a step
    assert epochs.losses == [0.0, 1.0, 10.0, 11.0]
    # the timed epoch's two calls, 4 ms each; the warm-up epoch's left out
    assert (epochs.tower.seconds, epochs.tower.count) == (pytest.approx(0.008), 2)
    assert epochs.epoch.count == 1


def test_on_cuda_each_timed_call_starts_and_ends_with_the_device_idle() -> None:
    module = load_module(SCRIPT)
    calls: list[str] = []
    assert module._median_us(lambda: calls.append("call"), 3, lambda: calls.append("sync")) > 0
    assert calls == ["sync", "call", "sync"] * 3
    calls.clear()
    module._median_us(lambda: calls.append("call"), 2)  # CPU: no sync
    assert calls == ["call", "call"]
