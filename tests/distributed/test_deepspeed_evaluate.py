"""DeepSpeed ZeRO-2 presets on two CPU processes validate, test and predict from a checkpoint.

Lightning's inference set-up passed DeepSpeed the CUDA index (None on CPU) as its device
rank: fit worked, and validate, test and predict raised a TypeError in DeepSpeed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.multiprocess import run_script


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("strategy", ["deepspeed_zero2", "deepspeed_zero2_offload"])
def test_preset_on_cpu_validates_tests_and_predicts_from_its_checkpoint(
    strategy: str, tmp_path: Path
) -> None:
    ranks = run_script("deepspeed_evaluate.py", tmp_path, "--strategy", strategy)
    for rank, result in enumerate(ranks):
        assert result["rank"] == rank
        # the checkpoint's weights, not a fresh module's: the fitted loss, well below
        assert result["fitted_loss"] < 0.8 * result["untrained_loss"]
        assert result["val_loss"] == pytest.approx(result["fitted_loss"], rel=1e-5)
        assert result["test_loss"] == pytest.approx(result["fitted_loss"], rel=1e-5)
        # each rank predicts its half of the samples (every second one, from its rank)
        mine = result["fitted_predictions"][rank::2]
        assert result["predictions"] == pytest.approx(mine, rel=1e-5, abs=1e-6)
