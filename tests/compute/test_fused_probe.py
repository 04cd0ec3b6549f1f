"""The probe of a fused/foreach kernel against the plain step, without an optimizer in training."""

from __future__ import annotations

import pytest
import torch

from lightning_speedkit.compute._fused_probe import _tolerance, devices_and_dtypes, probe


def _group(cls: type[torch.optim.Optimizer], dtype: torch.dtype, **options: object) -> dict:
    weight = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    return dict(cls([weight], lr=0.001, **options).param_groups[0])


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.bfloat16, 0.125), (torch.float16, 0.015625), (torch.float32, 1e-4),
     (torch.float64, 1e-4), (torch.int64, 1e-4)],
)  # fmt: skip
def test_the_tolerance_is_16_units_of_rounding_and_never_below_1e_4(
    dtype: torch.dtype, tolerance: float
) -> None:
    assert _tolerance(dtype) == tolerance


def test_a_group_is_probed_once_per_device_and_dtype() -> None:
    a, b = torch.ones(2), torch.ones(3, dtype=torch.float64)
    group = {"params": [a, b, torch.ones(1)]}
    assert devices_and_dtypes(group) == [
        (torch.device("cpu"), torch.float32),
        (torch.device("cpu"), torch.float64),
    ]
    assert probe(torch.optim.AdamW, {"params": []}, "fused") is None  # nothing to probe


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_adamw_on_the_cpu_runs_as_the_plain_step(dtype: torch.dtype) -> None:
    assert probe(torch.optim.AdamW, _group(torch.optim.AdamW, dtype), "fused") is None


def test_a_combination_torch_refuses_is_named_with_its_error() -> None:
    why = probe(torch.optim.Adam, _group(torch.optim.Adam, torch.complex64), "fused")
    assert why is not None
    assert why.startswith("refused these parameters (RuntimeError: `fused=True` requires all")


def test_a_kernel_that_moves_the_weights_too_little_does_not_match() -> None:
    # torch's fused SGD on the CPU leaves bf16 weights of 16 or more elements where they were
    why = probe(torch.optim.SGD, _group(torch.optim.SGD, torch.bfloat16), "fused")
    assert why is not None
    assert why.startswith("does not match the plain step on cpu bfloat16 parameters (it moves ")
