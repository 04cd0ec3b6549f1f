"""Discovery for the ``traced`` family: which modules compute attention, on their first call.

Each module that no other adapter claims gets a probe. The first call that
reaches a probed module runs once, unchanged, under a recording
``TorchFunctionMode``: every torch call, which tensors fed it, and which
module calls it happened in. In that record a softmax over the last axis
whose input comes, through scaling, masking and casts, from a product of two
tensors (``@``, ``matmul``, ``bmm``, ``baddbmm``, ``einsum``), and whose output
goes, through dropout and casts, into a second product, is attention when
both operands of the first product and the other operand of the second
derive from projections (a ``linear`` or matmul with a parameter). The
module that owns it is the innermost module call holding both products.
Names play no part: diffusers' old ``CrossAttention``, vit-pytorch's and
imagen-pytorch's ``Attention`` are found like any other.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_speedkit import _compat, _surgery
from lightning_speedkit.attention._traced import (
    _METADATA,
    _NESTING,
    _PRODUCTS,
    _PROJECTIONS,
    _SCORE_OPS,
    _WEIGHT_OPS,
    _name,
    _softmax_dim,
    _tensor_args,
    _tensor_outputs,
)

log = logging.getLogger(__name__)


@dataclass
class _Node:
    name: str
    parents: tuple[int, ...]
    """The nodes that produced this op's tensor arguments, in order (-1: made elsewhere)."""
    shape: tuple[int, ...] | None
    info: Any = None
    """softmax: its axis; projection: the parameter's id."""


@dataclass
class _Call:
    module: nn.Module
    enter: int
    inputs: tuple[tuple[Any, ...], dict[str, Any]]
    grad: bool
    exit: int | None = None


@dataclass(frozen=True)
class Found:
    """One attention found in a trace, and what its owner was called with."""

    owner: nn.Module
    inputs: tuple[tuple[Any, ...], dict[str, Any]]
    grad: bool
    detail: str


class _Trace:
    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.nodes: list[_Node] = []
        self.producer: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.calls: list[_Call] = []
        self.open: list[_Call] = []
        self.depth = _NESTING[0]
        self.broken = False

    def enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.calls:  # the root's inputs: named, so cross-attention shows
            for tensor in _tensor_args(args, kwargs):
                if tensor not in self.producer:
                    self.producer[tensor] = len(self.nodes)
                    self.nodes.append(_Node("input", (), tuple(tensor.shape)))
        grad = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        call = _Call(module, len(self.nodes), (args, kwargs), grad)
        self.calls.append(call)
        self.open.append(call)

    def exit(self, module: nn.Module) -> bool:
        """Close the module's call; ``True`` when that was the root's."""
        for i in range(len(self.open) - 1, -1, -1):
            if self.open[i].module is module:
                self.open[i].exit = len(self.nodes)
                del self.open[i:]
                break
        return not self.open

    def record(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        name = _name(func)
        if name in _METADATA:
            return
        tensors = list(_tensor_args(args, kwargs))
        parents = tuple(self.producer.get(t, -1) for t in tensors)
        outputs = _tensor_outputs(out)
        shape = tuple(outputs[0].shape) if outputs else None
        info: Any = None
        if name in _PROJECTIONS:
            weight = next((t for t in tensors if isinstance(t, nn.Parameter)), None)
            if weight is not None:
                name, info = "projection", id(weight)
        elif name == "softmax" and tensors:
            info = _softmax_dim(args, kwargs, tensors[0].ndim)
            if info != tensors[0].ndim - 1:
                name = "softmax (not over the last axis)"
        index = len(self.nodes)
        self.nodes.append(_Node(name, parents, shape, info))
        for tensor in outputs:
            self.producer[tensor] = index


class _Recorder(TorchFunctionMode):
    def __init__(self, trace: _Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        trace = self.trace
        if not trace.broken and _NESTING[0] == trace.depth:
            try:
                trace.record(func, args, kwargs, out)
            except Exception:  # never the user's step: this module just stays unswapped
                log.debug("recording %s failed", func, exc_info=True)
                trace.broken = True
        return out


class _ById:
    """A module as a set member or dict key by identity, whatever its own ``__hash__``.

    Copying a model (``copy.deepcopy``) copies a discovery's hooks and with them its
    module-keyed containers, rebuilding each key while the module it names may be half
    copied; a torchmetrics ``Metric`` hashes its state, which is not there yet, and the
    copy failed. This key hashes the module's identity, which a half-copied module has.
    (A ``Metric`` also makes ``==`` a new metric, always true: no module is keyed by
    its own hash here.)
    """

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __hash__(self) -> int:
        return id(self.module)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ById) and other.module is self.module


def find_attention(trace: _Trace, names: dict[int, str], owners: dict[_ById, str]) -> list[Found]:
    """Attention in a finished trace, one per owner (the innermost module holding it).

    ``names``: parameter id -> parameter name (for the report); ``owners``: the
    modules that may own an attention (by identity), with their names.
    """
    nodes = trace.nodes
    children: dict[int, list[int]] = {}
    for index, node in enumerate(nodes):
        for parent in node.parents:
            if parent >= 0:
                children.setdefault(parent, []).append(index)

    def back_to_product(start: int) -> int | None:
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

    def projection(start: int) -> int | None:
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

    def operands(i: int) -> tuple[int, ...]:
        node = nodes[i]
        return node.parents[1:] if node.name == "baddbmm" else node.parents

    def forward_to_product(start: int) -> tuple[int, int] | None:
        todo, seen = [start], set[int]()
        while todo:
            i = todo.pop(0)
            if i in seen or len(seen) > 32:
                continue
            seen.add(i)
            for child in children.get(i, []):
                node = nodes[child]
                if node.name in _PRODUCTS and len(operands(child)) == 2 and i in operands(child):
                    other = [p for p in operands(child) if p != i]
                    return child, (other[0] if other else -1)
                if node.name in _WEIGHT_OPS:
                    todo.append(child)
        return None

    def consumer_projection(start: int) -> int | None:
        todo, seen = [start], set[int]()
        while todo:
            i = todo.pop(0)
            if i in seen or len(seen) > 32:
                continue
            seen.add(i)
            for child in children.get(i, []):
                if nodes[child].name == "projection":
                    return child
                todo.append(child)
        return None

    found: dict[_ById, tuple[_Call, str]] = {}  # per module: its first call that holds one
    for s, node in enumerate(nodes):
        if node.name != "softmax" or not node.parents:
            continue
        p1 = back_to_product(node.parents[0])
        if p1 is None or len(operands(p1)) != 2:
            continue
        q_proj, k_proj = (projection(p) for p in operands(p1))
        after = forward_to_product(s)
        if q_proj is None or k_proj is None or after is None:
            continue
        p2, v_node = after
        v_proj = projection(v_node)
        if v_proj is None:
            continue
        call = _owner(trace.calls, p1, p2, owners)
        if call is None or _ById(call.module) in found:
            continue
        out = consumer_projection(p2)
        owner = owners[_ById(call.module)]
        detail = _describe(nodes, names, owner, p1, (q_proj, k_proj, v_proj), out)
        found[_ById(call.module)] = (call, detail)
    # An owner whose call holds another owner's call keeps its own forward: one swap per
    # attention, at the innermost module.
    calls = [call for call, _ in found.values()]
    result = []
    for call, detail in found.values():
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


class Installer(Protocol):
    """What a discovery does with what its traces find (``swap_attention``'s swaps).

    It is deep-copied with the discovery (see :meth:`Discovery.__deepcopy__`), through
    the copy's memo: what it changes (a report) must be its attributes, which the copy
    remaps, never a closure's, which the copy would share with the original.
    """

    def install(self, found: Found, name: str) -> None:
        """Swap an attention found, after its module's probes are gone."""

    def nothing_found(self, name: str) -> None:
        """A trace of the module called ``name`` found no attention."""


class Discovery:
    """Probes on candidate modules; the first call that reaches one is traced.

    The probes are forward hooks under one hook id, the same on every module:
    ``torch.compile`` guards on a module's hook ids, and blocks of one class
    must stay alike to share a compiled graph. A trace runs compiled regions
    eagerly (its record must see their calls), and removes the probes of every
    module it saw before anything is compiled with them; a probe reached inside
    compiled code does nothing.

    A deep copy of the model is a model of its own: its probes belong to a
    discovery of its own, which traces the copy's modules and hands what it finds
    to a copy of ``installer`` (see :meth:`__deepcopy__`); calls on either model
    never reach the other's installer.

    Args:
        model: the model whose attention is looked for.
        candidates: (module, name) pairs, the modules that may own an attention.
        installer: gets each attention found, and each trace that found none.
    """

    def __init__(
        self,
        model: nn.Module,
        candidates: Sequence[tuple[nn.Module, str]],
        installer: Installer,
    ) -> None:
        # The parameters themselves, not their ids: a copy maps them to its own.
        self.parameters = list(model.named_parameters(remove_duplicate=False))
        self.names = {id(p): name for name, p in self.parameters}
        self.candidates = {_ById(module): name for module, name in candidates}
        self.installer = installer
        self.trace: _Trace | None = None
        self.contexts: contextlib.ExitStack | None = None
        """While a trace runs: its recorder, the eager stance, forwards changing."""
        self.probes: set[_ById] = set()
        self.hook_id: int | None = None
        for module, _ in candidates:
            self._probe(module)
            _PROBED[id(module)] = self

    def __deepcopy__(self, memo: dict[int, Any]) -> Discovery:
        """The discovery of a deep copy of the model: the copy's probes, the copy's installer.

        ``copy.deepcopy`` reaches a discovery through the hooks of a probed module and
        copies functions by reference: copied field by field, the copy's traces would
        name the original's parameters and report into the original's installer (a
        module first called on an EMA copy swapped there, recorded in the original's
        report). Here every field is taken through ``memo``, so it is the copy's: the
        probed modules and their parameters, and the installer with what it holds (for
        ``swap_attention``, the report as it stood, whose entries are the copy's swaps'
        entries). Only modules still probed are kept: the others are decided, and the
        copy's hooks no longer reach them.
        """
        copied = Discovery.__new__(Discovery)
        memo[id(self)] = copied  # the copy's hooks, reached from here, name this one
        copied.parameters = copy.deepcopy(self.parameters, memo)
        copied.names = {id(p): name for name, p in copied.parameters}
        copied.probes = copy.deepcopy(self.probes, memo)
        copied.candidates = {
            copy.deepcopy(key, memo): name
            for key, name in self.candidates.items()
            if key in self.probes
        }
        copied.installer = copy.deepcopy(self.installer, memo)
        copied.trace = copied.contexts = None  # a trace runs in the original
        copied.hook_id = self.hook_id  # the key under which the copied hooks sit
        for key in copied.probes:
            _PROBED[id(key.module)] = copied
        return copied

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["trace"] = state["contexts"] = None  # a trace runs in the original
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A pickled model's discovery, loaded: it probes the loaded modules."""
        self.__dict__.update(state)
        for key in self.probes:
            _PROBED[id(key.module)] = self

    @property
    def pending(self) -> bool:
        """Some candidate has not been called yet."""
        return bool(self.probes)

    def _probe(self, module: nn.Module) -> None:
        if self.hook_id is None:
            self.hook_id = module.register_forward_pre_hook(self._enter, with_kwargs=True).id
        hook_id = self.hook_id
        pre, pre_kwargs, post, always = _compat.hook_dicts(module)
        pre[hook_id] = self._enter
        pre_kwargs[hook_id] = True
        post[hook_id] = self._exit
        always[hook_id] = True
        self.probes.add(_ById(module))

    def _unprobe(self, module: nn.Module) -> None:
        assert self.hook_id is not None
        for hooks in _compat.hook_dicts(module):
            hooks.pop(self.hook_id, None)
        self.probes.discard(_ById(module))
        _PROBED.pop(id(module), None)

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.trace is None:
            if torch.compiler.is_compiling() or _ById(module) not in self.probes:
                return
            self.trace = _Trace(module)
            self.contexts = contextlib.ExitStack()
            self.contexts.enter_context(_force_eager())
            # Swaps installed at the trace's end must not be what a checkpoint taken in it
            # recomputes: the kit's checkpoints run their blocks as they are meanwhile.
            self.contexts.enter_context(_surgery.forwards_changing())
            self.contexts.enter_context(_Recorder(self.trace))
        self.trace.enter(module, args, kwargs)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        trace = self.trace
        if trace is None or not trace.exit(module):
            return
        assert self.contexts is not None
        self.contexts.close()
        self.trace = self.contexts = None
        self._finish(trace)

    def _finish(self, trace: _Trace) -> None:
        found: list[Found] = []
        if not trace.broken and all(call.exit is not None for call in trace.calls):
            try:
                found = find_attention(trace, self.names, self.candidates)
            except Exception:
                log.debug("finding attention failed", exc_info=True)
        # Every module called in the trace is decided: its probes go before any check runs.
        for call in trace.calls:
            self._unprobe(call.module)
        for item in found:
            self.installer.install(item, self.candidates[_ById(item.owner)])
        if not found:
            name = self.candidates.get(_ById(trace.root), type(trace.root).__name__)
            self.installer.nothing_found(name)


def _force_eager() -> contextlib.AbstractContextManager[Any]:
    """torch.compile's ``force_eager`` stance for a trace, so that it sees the calls of
    compiled regions; nothing where the call already runs inside torch.compile's frame
    evaluation without being compiled (a compiled ``training_step`` that dynamo runs
    eagerly, as it does under a counting dispatch mode): dynamo refuses a stance change
    there ("attempted to set_stance in a torch.compile region")."""
    try:
        return torch.compiler.set_stance("force_eager")
    except RuntimeError:  # refused before changing anything
        return contextlib.nullcontext()


#: id(module) -> the discovery probing it (a module is probed once). Weak: a discovery
#: lives as long as the hooks of its modules hold it.
_PROBED: weakref.WeakValueDictionary[int, Discovery] = weakref.WeakValueDictionary()


def probed(module: nn.Module) -> bool:
    """Whether a discovery awaits this module's first call."""
    discovery = _PROBED.get(id(module))
    return discovery is not None and _ById(module) in discovery.probes
