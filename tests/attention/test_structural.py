"""The structural family, found by its projections' names and shapes, and its example input."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import Tensor, nn

from lightning_speedkit.attention._example_inputs import device_of, tokens
from lightning_speedkit.attention._structural import (
    Structure,
    structural_example,
    structural_forward,
    structural_match,
)


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: a fused ``c_attn``, ``c_proj``, ``n_head`` and a causal ``bias``."""

    def __init__(self, dim: int = 32, heads: int = 4, length: int = 12) -> None:
        super().__init__()
        self.n_head = heads
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.0), nn.Dropout(0.0)
        mask = torch.tril(torch.ones(length, length)).view(1, 1, length, length)
        self.register_buffer("bias", mask)

    def forward(self, x: Tensor) -> Tensor:
        raise AssertionError("not called: only its structure is read")


class GroupedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads = 4, 2
        self.q_proj, self.o_proj = nn.Linear(32, 32), nn.Linear(32, 32)
        self.k_proj, self.v_proj = nn.Linear(32, 16), nn.Linear(32, 16)


def test_a_fused_causal_attention_is_matched_with_what_it_is_made_of() -> None:
    assert structural_match(CausalSelfAttention()) == Structure(
        heads=4, kv_heads=4, head_dim=8, qkv="c_attn", q=None, k=None, v=None, out="c_proj",
        causal=True, max_len=12, attn_dropout="attn_dropout", out_dropout="resid_dropout",
        scale=None,
    )  # fmt: skip


def test_separate_projections_with_grouped_key_value_heads_are_matched() -> None:
    found = structural_match(GroupedAttention())
    assert isinstance(found, Structure)
    assert (found.heads, found.kv_heads, found.head_dim) == (4, 2, 8)
    assert (found.q, found.k, found.v, found.out, found.causal) == (
        "q_proj", "k_proj", "v_proj", "o_proj", False,
    )  # fmt: skip


def test_a_look_alike_is_refused_with_the_reason_and_others_are_not_ours() -> None:
    module = GroupedAttention()
    module.k_proj = nn.Linear(32, 24)
    module.v_proj = nn.Linear(32, 24)
    assert structural_match(module) == (
        "GroupedAttention: key/value projections do not match 2 key/value heads"
    )
    assert structural_match(nn.Linear(4, 4)) is None  # no head count
    assert structural_match(nn.MultiheadAttention(8, 2)) is None  # torch's own family


def test_the_forward_equals_the_eager_attention_it_replaces() -> None:
    from lightning_speedkit.attention.adapters import SwapContext
    from lightning_speedkit.attention.backends import Attend

    torch.manual_seed(0)
    module = CausalSelfAttention()
    x = torch.randn(2, 12, 32)
    ctx = SwapContext(module, module.forward, Attend("math"), structural_match(module))
    q, k, v = module.c_attn(x).split(32, dim=2)
    q, k, v = (t.view(2, 12, 4, 8).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1) / 8**0.5).masked_fill(module.bias == 0, float("-inf"))
    eager = module.c_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 12, 32))
    torch.testing.assert_close(structural_forward(ctx, x), eager, rtol=1e-5, atol=1e-6)
    assert structural_forward(ctx, torch.randn(2, 13, 32)) is NotImplemented  # past the mask


def test_the_example_input_is_fixed_and_no_longer_than_the_mask() -> None:
    module = CausalSelfAttention(length=12)
    example = structural_example(module)
    assert example is not None
    (x,), kwargs = example
    assert (x.shape, kwargs) == (torch.Size([2, 12, 32]), {})
    torch.testing.assert_close(x, tokens(module, 32, 12), rtol=0, atol=0)
    assert structural_example(nn.Linear(4, 4)) is None


def test_tokens_take_the_module_dtype_and_a_module_without_parameters_has_no_device() -> None:
    assert tokens(nn.Linear(4, 4).double(), 4, 3).dtype == torch.float64
    assert device_of(nn.ReLU()) is None
    assert device_of(nn.Linear(4, 4)) == torch.device("cpu")


@pytest.mark.parametrize(
    ("old", "now"),
    [
        ("_structural_match", structural_match),
        ("_structural_forward", structural_forward),
        ("_structural_example", structural_example),
        ("Structure", Structure),
    ],
)
def test_a_model_pickled_before_the_family_moved_finds_it(old: str, now: object) -> None:
    """A pickle names a swap's adapter functions and binding by module and name."""
    written_before = f"clightning_speedkit.attention.adapters\n{old}\n.".encode()
    assert pickle.loads(written_before) is now
