"""Learning-rate scaling on its own: the factor, and the exact rates put back after the step."""

from __future__ import annotations

import pytest
import torch

from lightning_speedkit import SpeedkitConfigError
from lightning_speedkit.schedule._lr_scaling import LrScaler, lr_factor


@pytest.mark.parametrize(
    ("scaling", "global_batch", "expected"),
    [("linear", 256, 2.0), ("linear", 64, 0.5), ("sqrt", 512, 2.0), ("sqrt", 32, 0.5)],
)
def test_the_factor_follows_the_global_batch(
    scaling: str, global_batch: int, expected: float
) -> None:
    assert lr_factor(global_batch, 128, scaling) == expected  # type: ignore[arg-type]


def test_the_step_takes_the_scaled_rate_and_the_group_keeps_its_own() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    adam_like = torch.optim.SGD([{"params": [param], "lr": 0.3}])
    scaler = LrScaler()
    scaler.hook([adam_like], "linear")
    scaler.factor = 3.0
    seen: list[float] = []
    adam_like.register_step_pre_hook(lambda opt, a, k: seen.append(opt.param_groups[0]["lr"]))
    param.grad = torch.ones(1)
    adam_like.step()
    assert seen == [pytest.approx(0.9)]  # the step ran at lr x 3
    assert adam_like.param_groups[0]["lr"] == 0.3  # exactly, not 0.3 * 3 / 3
    scaler.remove()
    adam_like.step()
    assert seen[-1] == 0.3


def test_no_scaling_hooks_nothing_and_a_foreign_optimizer_is_refused() -> None:
    scaler = LrScaler()
    scaler.hook([object()], None)  # no scaling: nothing to hook, nothing refused
    with pytest.raises(SpeedkitConfigError, match=r"`lr_scaling='sqrt'` needs a torch\.optim"):
        scaler.hook([object()], "sqrt")
