"""MicroBatchTuner beside the kit's own length bucketing (``speed_dataloader(lengths=...)``).

The tuner refuses a loader batched by a batch sampler, and told the user to "pass
`batch_size=` instead of `batch_sampler=`": but a SpeedDataModuleMixin user passed
``batch_size=`` and ``lengths=``, never a batch sampler. The refusal now names the kit's
bucketing and the fix that works with it.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import Dataset

from lightning_speedkit import (
    AccumulationScheduler,
    MicroBatchTuner,
    SpeedDataModuleMixin,
    SpeedkitConfigError,
)

from ..helpers.models import MLP


class Vectors(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((32,), float(index))


class Bucketed(SpeedDataModuleMixin, L.LightningDataModule):
    def train_dataloader(self) -> Any:
        data = Vectors()
        return self.speed_dataloader(data, batch_size=4, lengths=list(range(len(data))))


def test_the_kits_own_bucketing_is_named_with_a_fix_that_fits_it(tmp_path: Any) -> None:
    tuner = MicroBatchTuner(verbose=False)  # refused before anything is timed
    scheduler = AccumulationScheduler(target_global_batch=16, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, callbacks=[scheduler, tuner], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(SpeedkitConfigError) as error:
        trainer.fit(MLP(), datamodule=Bucketed())
    assert str(error.value) == (
        "MicroBatchTuner sets the train loader's `batch_size`, and this one batches with "
        "LengthBucketBatchSampler (length bucketing: SpeedDataModuleMixin's `lengths=`), "
        "whose own `batch_size` decides and which the tuner does not resize. To use the "
        "tuner, tune once without `lengths=` and pass the size it finds to "
        "`speed_dataloader(batch_size=...)` with `lengths=`; or remove MicroBatchTuner."
    )
    assert "batch_sampler=" not in str(error.value)
