"""The torch calls the traced family knows by name, and how their arguments are read."""

from __future__ import annotations

import torch

from lightning_speedkit.attention._op_vocabulary import (
    _arg,
    _broadcasts_into,
    _inplace,
    _name,
    _number,
    _softmax_dim,
    _tensor_args,
    _tensor_outputs,
)


def test_names_and_in_place_ops() -> None:
    assert _name(torch.matmul) == "matmul"
    assert _name(torch.Tensor.shape.__get__) == "shape"  # a property: its getter's name
    assert [_inplace(n) for n in ("add_", "__iadd__", "__setitem__", "__add__", "add")] == [
        True,
        True,
        True,
        False,
        False,
    ]


def test_arguments_are_read_by_position_or_name() -> None:
    x = torch.zeros(2, 3, 4)
    assert _arg((x, 2), {}, 1, "dim", None) == 2
    assert _arg((x,), {"dim": 0}, 1, "dim", None) == 0
    assert _arg((x,), {}, 1, "dim", "default") == "default"
    assert _softmax_dim((x, -1), {}, 3) == 2
    assert _softmax_dim((x,), {"dim": 1}, 3) == 1
    assert _softmax_dim((x,), {}, 3) is None


def test_tensors_in_arguments_and_outputs() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.ones(2)
    assert list(_tensor_args((a, [b, 3]), {"other": c})) == [a, b, c]
    assert _tensor_outputs((a, 1, b)) == [a, b]
    assert _tensor_outputs(3) == []


def test_numbers_and_broadcasting() -> None:
    assert [_number(v) for v in (1, 0.5, True, "1")] == [True, True, False, False]
    assert _broadcasts_into(torch.zeros(1, 4), (3, 4))
    assert not _broadcasts_into(torch.zeros(2, 4), (3, 4))
    assert not _broadcasts_into(torch.zeros(3, 1, 4), (3, 4))
