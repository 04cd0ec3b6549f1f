"""What MicroBatchTuner needs of a fit, checked on stand-in Trainers: each refusal says the fix."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from lightning_speedkit import AccumulationScheduler, SpeedkitConfigError
from lightning_speedkit.compute._fit_requirements import global_batch_scheduler, loader_to_tune


def _trainer(callbacks: list[Any], world_size: int = 1, **kw: Any) -> Any:
    return SimpleNamespace(strategy=object(), callbacks=callbacks, world_size=world_size,
                           accumulate_grad_batches=1, **kw)  # fmt: skip


AUTOMATIC = SimpleNamespace(automatic_optimization=True)


def test_the_scheduler_with_a_target_global_batch_is_the_one_kept() -> None:
    scheduler = AccumulationScheduler(target_global_batch=64)
    assert global_batch_scheduler(_trainer([object(), scheduler], 2), AUTOMATIC) is scheduler


def test_without_a_target_global_batch_the_refusal_says_how_to_add_one() -> None:
    with pytest.raises(SpeedkitConfigError) as caught:
        global_batch_scheduler(_trainer([], 2), AUTOMATIC)
    assert str(caught.value) == (
        "MicroBatchTuner changes the micro-batch and keeps the optimizer's global batch, so it "
        "needs that number, and there is no AccumulationScheduler. Add "
        "`AccumulationScheduler(target_global_batch=N)` to the callbacks, N the samples per "
        "optimizer step you train with (today: your loader's batch_size x 1 "
        "(accumulate_grad_batches) x 2 (ranks)), and drop the Trainer's "
        "`accumulate_grad_batches`."
    )


def test_a_global_batch_the_ranks_cannot_share_evenly_is_refused() -> None:
    scheduler = AccumulationScheduler(target_global_batch=10)
    with pytest.raises(SpeedkitConfigError, match=r"cannot be split evenly over 3 ranks"):
        global_batch_scheduler(_trainer([scheduler], 3), AUTOMATIC)


def test_manual_optimization_is_refused_with_the_way_to_tune_before_fit() -> None:
    manual = SimpleNamespace(automatic_optimization=False)
    with pytest.raises(SpeedkitConfigError, match=r"`result = tune_micro_batch\(model, loader"):
        global_batch_scheduler(_trainer([AccumulationScheduler(target_global_batch=8)]), manual)


def test_a_smoke_test_or_no_batch_at_all_is_not_tuned() -> None:
    assert loader_to_tune(_trainer([], fast_dev_run=True)) is None
    assert loader_to_tune(_trainer([], fast_dev_run=False, limit_train_batches=0)) is None
