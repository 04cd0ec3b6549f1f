"""How a module's attention operands map onto SDPA's (B, H, N, D) call: einsum, layouts."""

from __future__ import annotations

import pytest
import torch

from lightning_speedkit.attention._sdpa_layout import (
    _arrange,
    _einsum_operands,
    _einsum_terms,
    _letter_sizes,
    _mask4d,
    _product_dtype,
    _to4d,
)


def test_einsum_terms_spell_out_the_ellipsis_and_refuse_what_is_not_a_product() -> None:
    assert _einsum_terms("b h i d, b h j d -> b h i j", [4, 4]) == (["bhid", "bhjd"], "bhij")
    assert _einsum_terms("...id,...jd->...ij", [4, 3]) == (["ABid", "Bjd"], "ABij")
    assert _einsum_terms("iid,jd->ij", [3, 2]) is None  # a diagonal
    assert _einsum_terms("id,jd", [2, 2]) is None  # no output spelled
    assert _einsum_terms("id,jd->ij", [3, 2]) is None  # ranks do not match


def test_operands_come_as_varargs_or_one_list() -> None:
    a, b = torch.zeros(1), torch.ones(1)
    assert _einsum_operands(("i,i->", a, b)) == [a, b]
    assert _einsum_operands(("i,i->", [a, b])) == [a, b]


def test_arrange_permutes_and_broadcasts_missing_axes() -> None:
    t = torch.arange(6.0).reshape(2, 3)  # axes "ij"
    sizes = _letter_sizes(["ij", "k"], [(2, 3), (4,)])
    assert sizes == {"i": 2, "j": 3, "k": 4}
    arranged = _arrange(t, "ij", "jki", sizes)
    assert arranged.shape == (3, 4, 2)
    assert torch.equal(arranged[:, 1], t.T)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((5, 7), (1, 1, 5, 7)),
        ((2, 5, 7), (2, 1, 5, 7)),
        ((2, 3, 5, 7), (2, 3, 5, 7)),
        ((2, 3, 4, 5, 7), (6, 4, 5, 7)),
    ],
)
def test_to4d_is_sdpa_layout(shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    assert _to4d(torch.zeros(shape)).shape == expected


@pytest.mark.parametrize(
    ("batch", "expected"),
    [((), (1, 1, 5, 5)), ((2,), (1, 1, 5, 5)), ((2, 3), (1, 1, 5, 5)), ((2, 3, 4), (6, 4, 5, 5))],
)
def test_a_mask_follows_the_same_layout(batch: tuple[int, ...], expected: tuple[int, ...]) -> None:
    assert _mask4d(torch.ones(5, 5, dtype=torch.bool), batch).shape == expected


def test_a_products_dtype_is_autocasts_when_it_is_on() -> None:
    cpu = torch.device("cpu")
    assert _product_dtype(cpu, torch.float32, torch.float64) == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _product_dtype(cpu, torch.float32, torch.float32) == torch.bfloat16
