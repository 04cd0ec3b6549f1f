"""Attention in a recorded trace: the pattern, and the module that owns it.

A softmax over the last axis whose input comes, through scaling, masking and casts,
from a product of two tensors (``@``, ``matmul``, ``bmm``, ``baddbmm``, ``einsum``),
and whose output goes, through dropout and casts, into a second product, is
attention when both operands of the first product and the other operand of the
second derive from projections (a ``linear`` or matmul with a parameter). The
module that owns it is the innermost module call holding both products.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_speedkit.attention._op_vocabulary import _PRODUCTS, _SCORE_OPS, _WEIGHT_OPS
from lightning_speedkit.attention._trace_record import _ById, _Call, _Node, _Trace


@dataclass(frozen=True)
class Found:
    """One attention found in a trace, and what its owner was called with."""

    owner: nn.Module
    inputs: tuple[tuple[Any, ...], dict[str, Any]]
    grad: bool
    detail: str


class _Graph:
    """The trace's nodes with their children: the walks that find an attention's parts."""

    def __init__(self, nodes: list[_Node]) -> None:
        self.nodes = nodes
        self.children: dict[int, list[int]] = {}
        for index, node in enumerate(nodes):
            for parent in node.parents:
                if parent >= 0:
                    self.children.setdefault(parent, []).append(index)

    def back_to_product(self, start: int) -> int | None:
        """The product the scores at ``start`` come from, through score ops."""
        nodes = self.nodes
        todo, seen = [start], set[int]()
        while todo:
            i = todo.pop()
            if i < 0 or i in seen or len(seen) > 32:
                continue
            seen.add(i)
            if nodes[i].name in _PRODUCTS:
                return i
            if nodes[i].name in _SCORE_OPS:
                todo.extend(reversed(nodes[i].parents))
        return None

    def projection(self, start: int) -> int | None:
        """The nearest projection ``start`` derives from (breadth first)."""
        nodes = self.nodes
        todo, seen = [start], set[int]()
        while todo:
            i = todo.pop(0)
            if i < 0 or i in seen or len(seen) > 64:
                continue
            seen.add(i)
            if nodes[i].name == "projection":
                return i
            todo.extend(nodes[i].parents)
        return None

    def operands(self, i: int) -> tuple[int, ...]:
        """A product's two operands (``baddbmm``'s first argument is not one)."""
        node = self.nodes[i]
        return node.parents[1:] if node.name == "baddbmm" else node.parents

    def forward_to_product(self, start: int) -> tuple[int, int] | None:
        """The product the weights at ``start`` feed, through weight ops, and its other operand."""
        todo, seen = [start], set[int]()
        while todo:
            i = todo.pop(0)
            if i in seen or len(seen) > 32:
                continue
            seen.add(i)
            for child in self.children.get(i, []):
                node = self.nodes[child]
                operands = self.operands(child)
                if node.name in _PRODUCTS and len(operands) == 2 and i in operands:
                    other = [p for p in operands if p != i]
                    return child, (other[0] if other else -1)
                if node.name in _WEIGHT_OPS:
                    todo.append(child)
        return None

    def consumer_projection(self, start: int) -> int | None:
        """The first projection ``start``'s value reaches (the output projection)."""
        todo, seen = [start], set[int]()
        while todo:
            i = todo.pop(0)
            if i in seen or len(seen) > 32:
                continue
            seen.add(i)
            for child in self.children.get(i, []):
                if self.nodes[child].name == "projection":
                    return child
                todo.append(child)
        return None

    def attention_at(self, s: int) -> tuple[int, int, tuple[int, int, int]] | None:
        """Whether node ``s`` is an attention's softmax: its two products and q/k/v projections."""
        node = self.nodes[s]
        if node.name != "softmax" or not node.parents:
            return None
        p1 = self.back_to_product(node.parents[0])
        if p1 is None or len(self.operands(p1)) != 2:
            return None
        q_proj, k_proj = (self.projection(p) for p in self.operands(p1))
        after = self.forward_to_product(s)
        if q_proj is None or k_proj is None or after is None:
            return None
        p2, v_node = after
        v_proj = self.projection(v_node)
        if v_proj is None:
            return None
        return p1, p2, (q_proj, k_proj, v_proj)


def find_attention(trace: _Trace, names: dict[int, str], owners: dict[_ById, str]) -> list[Found]:
    """Attention in a finished trace, one per owner (the innermost module holding it).

    ``names``: parameter id -> parameter name (for the report); ``owners``: the
    modules that may own an attention (by identity), with their names.
    """
    graph = _Graph(trace.nodes)
    found: dict[_ById, tuple[_Call, str]] = {}  # per module: its first call that holds one
    for s in range(len(trace.nodes)):
        parts = graph.attention_at(s)
        if parts is None:
            continue
        p1, p2, qkv = parts
        call = _owner(trace.calls, p1, p2, owners)
        if call is None or _ById(call.module) in found:
            continue
        out = graph.consumer_projection(p2)
        owner = owners[_ById(call.module)]
        detail = _describe(trace.nodes, names, owner, p1, qkv, out)
        found[_ById(call.module)] = (call, detail)
    return _innermost(list(found.values()))


def _innermost(found: list[tuple[_Call, str]]) -> list[Found]:
    """The owners whose call holds no other owner's call.

    An owner whose call holds another owner's call keeps its own forward: one swap per
    attention, at the innermost module.
    """
    calls = [call for call, _ in found]
    result = []
    for call, detail in found:
        holds_another = any(
            other is not call
            and call.enter <= other.enter
            and other.exit is not None
            and call.exit is not None
            and other.exit <= call.exit
            for other in calls
        )
        if not holds_another:
            result.append(Found(call.module, call.inputs, call.grad, detail))
    return result


def _owner(calls: list[_Call], first: int, last: int, owners: dict[_ById, str]) -> _Call | None:
    best = None
    for call in calls:  # in order of entry: a later one that holds both is further in
        if (
            _ById(call.module) in owners
            and call.enter <= first
            and call.exit is not None
            and last < call.exit
        ):
            best = call
    return best


def _describe(
    nodes: list[_Node],
    names: dict[int, str],
    owner: str,
    product: int,
    qkv: tuple[int, int, int],
    out: int | None,
) -> str:
    """For the report: heads (from the shapes), cross-attention, the projections' names."""
    q, k, _ = qkv

    def short(index: int | None) -> str:
        if index is None:
            return "-"
        name = names.get(nodes[index].info, "?").removesuffix(".weight").removesuffix(".bias")
        return name.removeprefix(f"{owner}.") if owner else name

    shape = nodes[product].shape or ()
    heads: int | None = None
    if len(shape) == 4:
        heads = shape[1]
    elif len(shape) == 3:
        batch = (nodes[q].shape or (0,))[0]
        heads = shape[0] // batch if batch and shape[0] % batch == 0 else None
    parts = [f"{heads} heads" if heads else "heads ?"]
    if nodes[q].parents[:1] != nodes[k].parents[:1]:
        parts.append("cross-attention")
    projections = dict.fromkeys(short(i) for i in qkv)
    parts.append(f"q/k/v {'/'.join(projections)}, out {short(out)}")
    return ", ".join(parts)
