"""What a discovery's trace records: every torch call, the tensors that fed it, and
which module calls it happened in.

:class:`_Trace` is the record of one first call; :class:`_Recorder` is the
``TorchFunctionMode`` that fills it. Modules are keyed by identity (:class:`_ById`),
whatever their own ``__hash__``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_speedkit.attention._op_vocabulary import (
    _METADATA,
    _PROJECTIONS,
    _name,
    _softmax_dim,
    _tensor_args,
    _tensor_outputs,
)
from lightning_speedkit.attention._traced import _NESTING

log = logging.getLogger(__name__)


@dataclass
class _Node:
    """One torch call in the record."""

    name: str
    parents: tuple[int, ...]
    """The nodes that produced this op's tensor arguments, in order (-1: made elsewhere)."""
    shape: tuple[int, ...] | None
    info: Any = None
    """softmax: its axis; projection: the parameter's id."""


@dataclass
class _Call:
    """One module call: where in the record it began and ended, and its inputs."""

    module: nn.Module
    enter: int
    inputs: tuple[tuple[Any, ...], dict[str, Any]]
    grad: bool
    exit: int | None = None


class _Trace:
    """The record of one first call, from ``root``'s entry to its exit.

    ``grad``: the call's gradient mode, where the trace runs without gradients ahead of
    the call (a packed batch's, see :mod:`._discovery`); else each call's own.
    """

    def __init__(self, root: nn.Module, grad: bool | None = None) -> None:
        self.root = root
        self.grad = grad
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
        grad = self.grad
        if grad is None:
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
    """Records every torch call into ``trace`` (those inside other swapped modules aside)."""

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
