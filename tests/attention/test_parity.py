"""The parity check's measure: relative errors, the whole-gradient L2, tolerances, copies."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_speedkit.attention._input_copies import copy_inputs
from lightning_speedkit.attention._parity import (
    Run,
    eval_mode,
    is_half,
    relative_errors,
    tensors,
    tolerance_for,
    upcast,
    vector_error,
)


@pytest.mark.parametrize(
    ("dtypes", "expected"),
    [
        ([torch.float32], 1e-4),
        ([torch.float64], 1e-7),
        ([torch.float32, torch.bfloat16], 3e-2),  # the loosest dtype among the outputs
        ([torch.float16], 1e-2),
        ([torch.int64], 1e-4),  # no floating output: fp32's
    ],
)
def test_tolerance_is_the_loosest_of_the_outputs_dtypes(
    dtypes: list[torch.dtype], expected: float
) -> None:
    assert tolerance_for([torch.zeros(1, dtype=d) for d in dtypes]) == expected


def test_half_precision_is_told_apart() -> None:
    assert is_half([torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)])
    assert not is_half([torch.zeros(1), torch.zeros(1, dtype=torch.float64)])


def test_relative_error_scales_each_tensor_by_its_own_largest_value() -> None:
    ours, theirs = torch.tensor([2.0, -4.0]), torch.tensor([2.0, -3.0])
    errors = relative_errors([(ours, theirs)])
    assert errors is not None
    assert errors.tolist() == [0.25]  # |(-4) - (-3)| / 4


def test_relative_error_of_a_small_tensor_is_floored_at_a_hundredth_of_the_largest() -> None:
    big = torch.tensor([100.0])
    small, off = torch.tensor([0.5]), torch.tensor([0.6])
    errors = relative_errors([(big, big), (small, off)])
    assert errors is not None
    assert errors.tolist() == pytest.approx([0.0, 0.1], abs=1e-7)  # 0.1 / max(0.5, 1.0)


def test_relative_error_edge_cases() -> None:
    nan = torch.tensor([math.nan, 1.0])
    assert relative_errors([(nan, nan.clone())]).tolist() == [0.0]  # type: ignore[union-attr]
    ints = torch.tensor([1, 2])
    assert relative_errors([(ints, torch.tensor([1, 3]))]).tolist() == [math.inf]  # type: ignore[union-attr]
    assert relative_errors([(torch.zeros(2), torch.zeros(3))]) is None  # shapes differ
    assert relative_errors([(None, None)]).numel() == 0  # type: ignore[union-attr]


def test_parameter_gradient_error_is_relative_l2_of_the_whole_vector() -> None:
    # Per tensor the second gradient is 25% off; the whole gradient (norm 5) moves by 1.
    ours = [torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])]
    theirs = [torch.tensor([3.0, 0.0]), torch.tensor([0.0, 3.0])]
    error = vector_error(list(zip(ours, theirs, strict=True)))
    assert error is not None
    assert error.tolist() == pytest.approx([0.2], abs=1e-7)


def test_a_gradient_missing_on_one_side_counts_as_zeros() -> None:
    error = vector_error(
        [(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])), (None, torch.ones(1))]
    )
    assert error is not None
    assert error.tolist() == pytest.approx([0.2], abs=1e-7)  # |1| / |(3, 4)|


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 3).double()


def test_run_error_is_zero_for_the_same_forward_and_the_scale_of_a_changed_one() -> None:
    linear = _linear()
    x = torch.randn(2, 4, dtype=torch.float64)
    inputs = copy_inputs((x,), {}, requires_grad=True)
    own = Run(lambda: linear(*inputs[0]), inputs, linear, grad=True)
    same = Run(lambda: linear(*inputs[0]), inputs, linear, grad=True)
    scaled = Run(lambda: linear(*inputs[0]) * 1.01, inputs, linear, grad=True)
    assert len(own.grads) == 3  # the input, the weight, the bias
    assert own.error(same) == 0.0
    # Outputs, input and parameter gradients all 1% off.
    assert own.error(scaled) == pytest.approx(0.01, rel=1e-5)  # compared in float32


def test_run_error_is_infinite_when_the_outputs_do_not_line_up() -> None:
    linear = _linear()
    inputs = copy_inputs((torch.randn(2, 4, dtype=torch.float64),), {}, requires_grad=False)
    own = Run(lambda: linear(*inputs[0]), inputs, linear, grad=False)
    two = Run(lambda: (linear(*inputs[0]), linear(*inputs[0])), inputs, linear, grad=False)
    assert own.error(two) == math.inf


def test_copies_keep_aliasing_and_get_gradients_and_the_reference_upcasts() -> None:
    x = torch.ones(2, 3, dtype=torch.bfloat16)
    (a, b), kwargs = copy_inputs((x, x), {"n": 3}, requires_grad=True)
    assert a is b  # self-attention stays self-attention
    assert a is not x
    assert a.requires_grad
    assert not a.is_leaf
    assert kwargs == {"n": 3}
    (up,), _ = copy_inputs((x,), {}, requires_grad=False, upcast=True)
    assert up.dtype == torch.float32
    assert not up.requires_grad
    assert [t.shape for t in tensors(((x,), {"k": [x, 1]}))] == [(2, 3), (2, 3)]


def test_eval_mode_and_upcast_put_everything_back() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout()).to(torch.bfloat16)
    model[1].eval()  # a mode of its own, kept
    storage = model[0].weight.data_ptr()
    with eval_mode(model), upcast(model):
        assert not any(m.training for m in model.modules())
        assert model[0].weight.dtype == torch.float32
    assert [m.training for m in model.modules()] == [True, True, False]
    assert model[0].weight.dtype == torch.bfloat16
    assert model[0].weight.data_ptr() == storage
