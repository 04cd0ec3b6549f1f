"""The swap-training benchmark must keep working; its GPU numbers are in docs/attention.md."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.modules import load_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "swap_training.py"


def test_swap_training_compares_each_backend_with_the_models_own(tmp_path: Path) -> None:
    module = load_module(SCRIPT)
    out = tmp_path / "swap.json"
    assert module.main(["--steps", "3", "--batches", "2", "--val-batches", "1",
                        "--batch-size", "8", "--backends", "math", "sdpa",
                        "--out", str(out)]) == 0  # fmt: skip
    saved = json.loads(out.read_text())
    own, math, sdpa = saved["rows"]
    assert [own["variant"], math["variant"], sdpa["variant"]] == ["own", "math", "sdpa"]
    # Every attention module of the tiny VLM really runs the backend asked for.
    assert own["kernels"] == {}
    assert math["kernels"] == {"math": 4}
    assert sdpa["kernels"] == {"sdpa": 4}
    assert saved["complete"] is True
    # Each module's parity check is in the record, the decoder's as well as the vision's.
    assert own["parity"] == []
    for row in (math, sdpa):
        checks = {m["name"]: m for m in row["parity"]}
        assert sorted(checks) == [
            "model.language_model.blocks.0.attn",
            "model.language_model.blocks.1.attn",
            "model.vision.blocks.0.attn",
            "model.vision.blocks.1.attn",
        ]
        for check in checks.values():
            assert (check["status"], check["backend"]) == ("active", row["variant"])
            assert check["checked"] == "forward+backward"
            assert 0.0 <= check["parity_error"] < 1e-5  # float32 rounding on CPU
    # In float32 on CPU the model's own gradient is the reference itself, and the fused
    # kernels compute the same function to float32 rounding.
    assert own["grad_rel_error"] == 0.0
    assert 0.0 <= sdpa["grad_rel_error"] < 1e-5
    for row in saved["rows"]:
        assert len(row["loss_curve"]) == 3
        assert row["nonfinite_steps"] == 0
        assert row["held_out_loss"] == row["held_out_loss"]  # not NaN
        # The first loss, from one initialisation on the same batch, agrees to rounding.
        assert abs(row["loss_curve"][0] - own["loss_curve"][0]) < 1e-4
