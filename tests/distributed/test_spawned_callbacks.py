"""``strategy="ddp_spawn"`` pickles the Trainer, callbacks included, to start its ranks:
every kit callback must survive a pickle and a deepcopy, fresh, and work in the ranks."""

from __future__ import annotations

import copy
import inspect
import pickle
from pathlib import Path

import lightning as L
import pytest

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
