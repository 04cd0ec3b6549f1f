"""Deferred scores: a placeholder replays the module's own code, step by step, when used."""

from __future__ import annotations

import torch

from lightning_speedkit.attention._deferred_scores import (
    _SELF,
    _cast_dtype,
    _descends,
    _is_plain,
    _Placeholder,
    _Scores,
)


def _placeholder() -> tuple[_Placeholder, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 4, generator=generator), torch.randn(2, 5, 4, generator=generator)
    k_t = k.transpose(-1, -2)
    scores = _Scores((torch.matmul, (q, k_t), {}), None, q, k)
    return _Placeholder(scores, (2, 3, 5), torch.float32), q @ k_t


def test_a_placeholder_stands_for_its_eager_value_without_storage() -> None:
    placeholder, eager = _placeholder()
    assert placeholder.eager_shape == (2, 3, 5)
    assert placeholder.eager_dtype == torch.float32
    assert torch.equal(placeholder.scores.compute(), eager)


def test_derived_steps_replay_on_their_parents_value() -> None:
    placeholder, eager = _placeholder()
    scaled = placeholder.scores.derive((torch.mul, (_SELF, 0.5), {}), scale=0.5)
    assert scaled.scale == 0.5
    assert scaled.parent is placeholder.scores
    assert torch.equal(scaled.compute(), eager * 0.5)
    assert _descends(scaled, placeholder.scores)
    assert not _descends(placeholder.scores, scaled)


def test_used_outside_the_fused_forward_it_is_computed() -> None:
    placeholder, eager = _placeholder()
    assert torch.equal(torch.softmax(placeholder, dim=-1), torch.softmax(eager, dim=-1))
    assert placeholder.shape == (2, 3, 5)  # metadata needs no value


def test_casts_only_change_the_dtype_it_stands_for() -> None:
    placeholder, _ = _placeholder()
    assert _cast_dtype("float", (), {}, placeholder) == torch.float32
    assert _cast_dtype("to", (torch.bfloat16,), {}, placeholder) == torch.bfloat16
    assert _cast_dtype("to", (), {"dtype": torch.float16}, placeholder) == torch.float16
    assert _cast_dtype("contiguous", (), {}, placeholder) == torch.float32
    assert _cast_dtype("type_as", (torch.zeros(1, dtype=torch.float64),), {}, placeholder) == (
        torch.float64
    )
    assert _cast_dtype("to", ("cpu", torch.float16), {}, placeholder) is None  # more than a cast
    assert _cast_dtype("to", (torch.int64,), {}, placeholder) is None


def test_only_floating_activations_are_plain() -> None:
    placeholder, eager = _placeholder()
    assert _is_plain(eager)
    assert not _is_plain(placeholder)
    assert not _is_plain(torch.nn.Parameter(torch.zeros(1)))
    assert not _is_plain(torch.zeros(1, dtype=torch.int64))
