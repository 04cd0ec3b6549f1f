"""One fit's accumulation windows on their own: counts, policy answers, changes, state."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from lightning_speedkit.schedule import _accumulation_wiring as wiring
from lightning_speedkit.schedule._accumulation_windows import (
    AccumulationChange,
    AccumulationWindows,
)
from lightning_speedkit.schedule._window_timing import WARMUP_WINDOWS
from lightning_speedkit.schedule.policies import CommShare


def _run(windows: AccumulationWindows, steps: list[int]) -> list[AccumulationChange]:
    changes = []
    for step in steps:
        if windows.micro_batch(step):
            change, _ = windows.open(step)
            if change is not None:
                changes.append(change)
    return changes


def test_windows_follow_a_schedule_mid_epoch_and_scale_the_lr() -> None:
    windows = AccumulationWindows(
        {"schedule": {0: 32, 2: 128}}, micro_batch=8, world_size=2, lr_scaling="sqrt"
    )
    # two windows of 2 micro-batches, then 8 per window from step 2 on
    changes = _run(windows, [0, 0, 1, 1] + [2] * 8)
    assert changes == [
        AccumulationChange(0, 2, 32, "schedule[0] = 32"),
        AccumulationChange(2, 8, 128, "schedule[2] = 128"),
    ]
    assert (windows.count, windows.done(), windows.base) == (8, True, 32)
    assert windows.lr.factor == 2.0  # sqrt(128 / 32)


def test_a_micro_batch_at_a_new_step_opens_a_window_even_when_short() -> None:
    windows = AccumulationWindows({"target_global_batch": 32}, micro_batch=8)
    assert windows.micro_batch(0)
    windows.open(0)
    assert windows.starts()
    assert not windows.micro_batch(0)
    assert (windows.count, windows.starts(), windows.done()) == (2, False, False)
    windows.epoch_start()  # Lightning stepped on the epoch's last batch
    assert windows.micro_batch(1)


def test_a_resumed_run_keeps_its_base_and_adaptive_state() -> None:
    first = AccumulationWindows({"max_global_batch": 256}, micro_batch=8, world_size=2)
    _run(first, [0, 0])  # the adaptive probe: 2 micro-batches
    state = first.state_dict()
    assert state == {"accumulation": 2, "global_batch": 32, "base_global_batch": 32,
                     "probed": True, "next_check": 0}  # fmt: skip
    resumed = AccumulationWindows({"max_global_batch": 256}, micro_batch=8, world_size=2)
    resumed.resume({**state, "global_batch": 64}, adaptive=True)
    (change,) = _run(resumed, [5])
    assert change == AccumulationChange(5, 4, 64, "resumed at global batch 64")
    assert resumed.state_dict()["base_global_batch"] == 32


def test_an_adaptive_window_start_hands_the_policy_a_measurement() -> None:
    windows = AccumulationWindows({"max_global_batch": 128}, micro_batch=8, world_size=2,
                                  measure_steps=1)  # fmt: skip
    slow = CommShare(accumulation=2, step_s=1.0, micro_batch_s=0.1, comm_s=0.8, optimizer_s=0.0)
    shared: list[Any] = []

    def share(mine: CommShare | None) -> CommShare:
        shared.append(mine)
        return slow  # rank 0's measurement, whatever this rank made

    _run(windows, [0, 0])
    windows.timer.windows = [types.SimpleNamespace(tainted=False)] * (WARMUP_WINDOWS + 1)  # type: ignore[list-item]
    change, measured = windows.open(1, measures=False, share=share)
    assert measured is slow
    assert shared == [None]  # this rank did not measure
    assert change == AccumulationChange(1, 8, 128, windows.policy.reason if windows.policy else "")
    assert windows.timer.windows == []


def test_the_short_last_window_is_scaled_to_its_mean() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([1.0, 2.0])
    sgd = torch.optim.SGD([param], lr=1.0)
    wiring.rescale_short_window(sgd, accumulation=4, count=1)
    assert param.grad.tolist() == [4.0, 8.0]
    wiring.rescale_short_window(sgd, accumulation=4, count=4)  # a full window: untouched
    assert param.grad.tolist() == [4.0, 8.0]


@pytest.mark.parametrize(("engine", "lightning", "deepspeed"), [(False, 4, None), (True, 1, 64)])
def test_the_accumulation_goes_to_lightning_or_to_deepspeed(
    engine: bool, lightning: int, deepspeed: int | None
) -> None:
    trainer: Any = types.SimpleNamespace(accumulate_grad_batches=1)
    set_to: list[int] = []
    fake = types.SimpleNamespace(
        train_micro_batch_size_per_gpu=lambda: 8, dp_world_size=2,
        set_train_batch_size=set_to.append,
    )  # fmt: skip
    wiring.set_accumulation(trainer, fake if engine else None, 4)
    assert trainer.accumulate_grad_batches == lightning
    assert set_to == ([deepspeed] if deepspeed else [])


def test_a_resumed_window_closes_at_the_epochs_end_when_less_is_left_now() -> None:
    """A window saved after 1 of its 4 micro-batches, resumed where the epoch has only 2
    left (another `limit_train_batches`): it closes at the epoch's last micro-batch, so
    DeepSpeed's engine steps there, on the 2 it has."""
    windows = AccumulationWindows({"target_global_batch": 32}, micro_batch=8)
    windows.resume({"window": {"step": 1, "count": 1, "length": 4}}, adaptive=False)
    assert windows.micro_batch(1)
    windows.open(1, left=2)
    assert (windows.count, windows.length, windows.had()) == (2, 3, 1)
    assert not windows.done()
    assert not windows.micro_batch(1)
    assert windows.done()
    assert windows.had() == 2
