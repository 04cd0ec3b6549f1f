"""NumWorkersTuner in a smoke test: ``fast_dev_run`` and ``limit_train_batches=0`` train one
batch or none, and the search at fit start (up to ``time_budget``, 120 s by default, and
every candidate's batches) outlasted them many times over. Now it says why and leaves
the loader as given, as MicroBatchTuner does."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest

from lightning_speedkit import NumWorkersTuner
from lightning_speedkit.data import _train_loader

from ..helpers.models import MLP, loader


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        ({"fast_dev_run": True}, "NumWorkersTuner: not tuning in a `fast_dev_run` (a smoke "
                                 "test); the train loader runs as given."),
        ({"limit_train_batches": 0, "max_epochs": 1},
         "NumWorkersTuner: `limit_train_batches=0`, no batch trains; not tuning."),
    ],
)  # fmt: skip
def test_a_smoke_test_is_not_tuned(
    flags: dict[str, Any],
    said: str,
    figures: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
) -> None:
    # Read what the tuner says where it says it: another test in the process may have
    # stopped Lightning's loggers from propagating to the capture.
    infos: list[str] = []
    monkeypatch.setattr(_train_loader, "rank_zero_info", infos.append)
    measured = figures({0: 100.0, 1: 300.0, 2: 400.0})
    tuner = NumWorkersTuner(max_workers=2, cache=False, progress=False)
    trainer = L.Trainer(
        accelerator="cpu", callbacks=[tuner], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        **flags,
    )  # fmt: skip
    given = loader()
    trainer.fit(MLP(), given)
    assert measured.seen == []  # no candidate was timed
    assert tuner.result is None
    assert said in infos
    if trainer.train_dataloader is not None:  # the loader as given: no workers added
        assert trainer.train_dataloader.num_workers == 0
