"""Discovery for the ``traced`` family: which modules compute attention, on their first call.

Each module that no other adapter claims gets a probe. The first call that
reaches a probed module runs once, unchanged, under a recording
``TorchFunctionMode``: every torch call, which tensors fed it, and which
module calls it happened in (:mod:`._trace_record`). In that record a softmax over
the last axis whose input comes, through scaling, masking and casts, from a product
of two tensors (``@``, ``matmul``, ``bmm``, ``baddbmm``, ``einsum``), and whose
output goes, through dropout and casts, into a second product, is attention when
both operands of the first product and the other operand of the second
derive from projections (a ``linear`` or matmul with a parameter). The
module that owns it is the innermost module call holding both products
(:mod:`._attention_pattern`).
Names play no part: diffusers' old ``CrossAttention``, vit-pytorch's and
imagen-pytorch's ``Attention`` are found like any other.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from lightning_speedkit import _compat, _surgery
from lightning_speedkit.attention._attention_pattern import Found, find_attention
from lightning_speedkit.attention._trace_record import _ById, _Recorder, _Trace  # pickles: _ById

log = logging.getLogger(__name__)


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
