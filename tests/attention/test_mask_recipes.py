"""Masks made from buffers alone: their recipes, and whether one is SDPA's causal mask."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_speedkit.attention._deferred_scores import _Scores
from lightning_speedkit.attention._mask_recipes import (
    BufferRecipes,
    _lower_triangular,
    _negative,
    sdpa_mask,
)

TRIL = torch.ones(4, 4, dtype=torch.bool).tril()


def test_a_lower_triangular_keep_or_bias_is_causal() -> None:
    assert _lower_triangular(TRIL, None, 4, 4)
    assert not _lower_triangular(TRIL.T, None, 4, 4)
    bias = torch.zeros(4, 4).masked_fill(~TRIL, float("-inf"))
    assert _lower_triangular(None, bias, 4, 4)
    assert not _lower_triangular(None, bias + 0.5, 4, 4)  # a real bias, not a mask
    assert _lower_triangular(TRIL, torch.zeros(4, 4), 4, 4)


def test_a_large_negative_is_a_mask_value() -> None:
    assert [_negative(v) for v in (-1e4, float("-inf"), -1.0, True, "x")] == [
        True,
        True,
        False,
        False,
        False,
    ]


def _scores(**changes: Any) -> _Scores:
    q = torch.zeros(1, 4, 2)
    return _Scores((torch.matmul, (), {}), None, q, q, **changes)


def test_a_causal_mask_from_buffers_becomes_is_causal_checked_once() -> None:
    recipe = (("fill", "the recipe"),)
    cache: dict[Any, bool] = {}
    assert sdpa_mask(_scores(keep=TRIL, mask_recipe=recipe), 4, 4, cache) == (None, True)
    assert cache == {(4, 4, recipe): True}
    cache[(4, 4, recipe)] = False  # the answer is remembered, not computed again
    mask, causal = sdpa_mask(_scores(keep=TRIL, mask_recipe=recipe), 4, 4, cache)
    assert mask is TRIL
    assert not causal


def test_a_mask_from_inputs_is_passed_as_attn_mask() -> None:
    cache: dict[Any, bool] = {}
    assert sdpa_mask(_scores(), 4, 4, cache) == (None, False)
    bias = torch.full((4, 4), 0.5)
    mask, causal = sdpa_mask(_scores(keep=TRIL, bias=bias, mask_recipe=None), 4, 4, cache)
    assert not causal
    assert torch.equal(mask, bias.masked_fill(~TRIL, float("-inf")))  # type: ignore[arg-type]
    assert cache == {}


def test_recipes_follow_what_is_made_from_buffers_alone() -> None:
    module = nn.Module()
    module.register_buffer("mask", TRIL.clone())
    recipes = BufferRecipes(module)
    buffer = module.mask
    assert recipes.get(buffer) == ("buffer", "mask")
    inverted = torch.logical_not(buffer)
    recipes.note("logical_not", (buffer,), {}, [buffer], inverted)
    made = ("logical_not", (("buffer", "mask"),), ())
    assert recipes.get(inverted) == (made, 0)
    assert recipes.extend((), "fill", inverted) == (("fill", (made, 0)),)
    assert recipes.extend(None, "fill", inverted) is None  # the scores' masks came from inputs
    x = torch.ones(4, 4, dtype=torch.bool)
    mixed = buffer & x
    recipes.note("__and__", (buffer, x), {}, [buffer, x], mixed)
    assert recipes.get(mixed) is None  # made with an input
    recipes.note("logical_and_", (buffer, x), {}, [buffer, x], buffer)
    assert recipes.get(buffer) is None  # a buffer written with an input has no recipe
