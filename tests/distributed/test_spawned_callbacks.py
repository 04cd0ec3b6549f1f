"""``strategy="ddp_spawn"`` pickles the Trainer, callbacks included, to start its ranks:
every kit callback must survive a pickle and a deepcopy, fresh, and work in the ranks."""

from __future__ import annotations

import copy
import inspect
import pickle
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_speedkit
from tests.helpers.multiprocess import run_script

ARGUMENTS = {"AccumulationScheduler": {"target_global_batch": 32}}
CALLBACKS = [
    name
    for name in lightning_speedkit.__all__
    if inspect.isclass(getattr(lightning_speedkit, name))
    and issubclass(getattr(lightning_speedkit, name), L.Callback)
]


@pytest.mark.parametrize("name", CALLBACKS)
def test_every_callback_survives_a_pickle_and_a_deepcopy(name: str) -> None:
    callback = getattr(lightning_speedkit, name)(**ARGUMENTS.get(name, {}))
    for copied in (pickle.loads(pickle.dumps(callback)), copy.deepcopy(callback)):
        assert type(copied) is type(callback)
        assert copied.state_dict() == callback.state_dict()


def test_the_callbacks_that_held_a_thread_or_a_closure_work_in_spawned_ranks(
    tmp_path: Path,
) -> None:
    ranks = run_script("spawn_callbacks.py", tmp_path, fresh=True)
    for rank in ranks:
        assert rank["global_step"] == 2
        assert rank["watched"] == [True] * 4  # HangWatchdog's thread ran in the rank
        assert rank["global_batches"] == [32]  # 2 micro-batches of 8 on each of 2 ranks
        assert rank["traced"]  # ProfilerSchedule recorded the rank's window
        assert rank["samples_per_sec"] > 0


class _Blocks(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch[0]
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("name", CALLBACKS)
def test_every_callback_still_pickles_after_a_fit(name: str, tmp_path: Path) -> None:
    """A fit's closures (a plugin method put on an instance, a loop taken over) go with
    the fit: a callback kept for a second Trainer, or one under ddp_spawn, pickles."""
    callbacks = [getattr(lightning_speedkit, name)(**ARGUMENTS.get(name, {}))]
    if name == "MicroBatchTuner":  # it keeps the global batch AccumulationScheduler holds
        callbacks.append(lightning_speedkit.AccumulationScheduler(target_global_batch=16))
    trainer = L.Trainer(accelerator="cpu", max_steps=3, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(_Blocks(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=8))
    for callback in callbacks:
        assert type(pickle.loads(pickle.dumps(callback))) is type(callback)
