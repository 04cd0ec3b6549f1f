"""The frozen-tower benchmark keeps working; its numbers are recorded in docs/frozen-features.md."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.modules import load_on_small_corpus

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
