"""Attention found in a recorded trace by what it computes, and the module that owns it."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_speedkit.attention._attention_pattern import _innermost, find_attention
from lightning_speedkit.attention._trace_record import _ById, _Call, _Recorder, _Trace

from .test_traced import ViTAttention


def _record(model: nn.Module, x: Tensor) -> _Trace:
    """A trace of ``model(x)``, its own call the only module call recorded."""
    trace = _Trace(model)
    with _Recorder(trace):
        trace.enter(model, (x,), {})
        model(x)
    assert trace.exit(model)  # the root's call closed
    return trace


def test_attention_is_found_with_its_heads_and_projections() -> None:
    torch.manual_seed(0)
    model = ViTAttention()
    x = torch.randn(2, 5, 32)
    trace = _record(model, x)
    names = {id(p): name for name, p in model.named_parameters()}
    found = find_attention(trace, names, {_ById(model): ""})
    assert len(found) == 1
    assert found[0].owner is model
    assert found[0].inputs[0][0] is x
    assert found[0].detail == "4 heads, q/k/v to_qkv, out to_out.0"


def test_the_record_names_projections_and_the_softmax() -> None:
    model = ViTAttention()
    trace = _record(model, torch.randn(2, 5, 32))
    names = [node.name for node in trace.nodes]
    assert names[0] == "input"
    assert names.count("projection") == 2  # to_qkv and to_out's Linear
    assert names.count("softmax") == 1
    softmax = trace.nodes[names.index("softmax")]
    assert softmax.info == 3  # over the last axis of (b, h, i, j)


class _NoProjections(nn.Module):
    """Softmax between two products of the input itself: not attention by structure."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.softmax(x @ x.transpose(-1, -2), dim=-1) @ x


def test_a_softmax_between_products_of_unprojected_inputs_is_not_attention() -> None:
    model = _NoProjections()
    trace = _record(model, torch.randn(2, 5, 8))
    assert find_attention(trace, {}, {_ById(model): ""}) == []


def test_a_module_not_offered_as_an_owner_owns_nothing() -> None:
    model = ViTAttention()
    trace = _record(model, torch.randn(2, 5, 32))
    assert find_attention(trace, {}, {}) == []


def test_of_nested_owners_the_innermost_keeps_the_attention() -> None:
    outer, inner, beside = nn.Identity(), nn.Identity(), nn.Identity()
    calls = [
        (_Call(outer, 0, ((), {}), True, exit=10), "outer"),
        (_Call(inner, 2, ((), {}), True, exit=8), "inner"),
        (_Call(beside, 11, ((), {}), False, exit=12), "beside"),
    ]
    kept = _innermost(calls)
    assert [(f.owner, f.detail, f.grad) for f in kept] == [
        (inner, "inner", True),
        (beside, "beside", False),
    ]


def test_modules_are_keyed_by_identity() -> None:
    a, b = nn.Identity(), nn.Identity()
    assert _ById(a) == _ById(a)
    assert _ById(a) != _ById(b)
    assert len({_ById(a), _ById(a), _ById(b)}) == 2
