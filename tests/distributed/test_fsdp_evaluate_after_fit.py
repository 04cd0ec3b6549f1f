"""``fsdp_zero2`` on a model with no repeated blocks wraps the whole model as one unit;
``validate`` and ``test`` with the Trainer that fitted it wrapped it a second time, over
parameters that were views of the first wrapper's flat parameter, and raised."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.multiprocess import run_script


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_unit_model_validates_and_tests_after_fit_with_the_fitted_weights(
    tmp_path: Path,
) -> None:
    ranks = run_script("fsdp_evaluate_after_fit.py", tmp_path)
    for rank, result in enumerate(ranks):
        assert result["rank"] == rank
        assert result["blocks"] == []  # one FSDP unit: the whole model
        # the fitted weights: the loss a new Trainer reads from the fit's last checkpoint
        assert result["val_after_fit"] == pytest.approx(result["val_from_checkpoint"], rel=1e-6)
        assert result["test_after_fit"] == pytest.approx(result["val_from_checkpoint"], rel=1e-6)
