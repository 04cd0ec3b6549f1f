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

A first call on a packed batch (its documents active, :mod:`._documents`) is traced
*ahead* of itself: the module's forward runs once on copies of the call's inputs,
without gradients, its random draws put back, its FLOPs not counted, its batch norms
in eval mode, and what it finds is swapped and checked before the call itself runs,
swapped, with each document apart. Traced as it ran, the call would have computed
the module's own attention over whole packed rows, across the documents of a row,
for the model's first step. The module's forward thus runs twice on that call: what
it changes besides its output (a buffer updated in place, said once; a Python
counter) changes twice. Where the forward cannot run ahead (a module holding FSDP2
units, whose parameters its own call gathers; a forward that raises on the copies),
the call is traced as it runs, and what it finds is named in a warning with the fix.

So is a first call with gradients that checkpoints blocks by the model's own gradient
checkpointing (diffusers' or transformers' ``gradient_checkpointing`` flags,
:mod:`._hf_checkpointing`): traced as it ran, its checkpoints would recompute, in
backward, the swaps installed at its end, not the attention it ran (torch's
``CheckpointError``). Ahead, without gradients, nothing is checkpointed, and the call
runs swapped and checkpointed as the user asked. A call traced as it runs (one that
cannot run ahead) has those checkpoint functions, like the kit's own checkpoints, run
their blocks unchecked.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from lightning_speedkit import _compat, _surgery
from lightning_speedkit._random import random_state_kept
from lightning_speedkit.attention import _documents
from lightning_speedkit.attention._attention_pattern import Found, find_attention
from lightning_speedkit.attention._hf_checkpointing import checkpoints_itself, checkpoints_paused
from lightning_speedkit.attention._input_copies import copy_inputs
from lightning_speedkit.attention._op_vocabulary import _tensor_args
from lightning_speedkit.attention._parity import force_eager, fsdp2_units
from lightning_speedkit.attention._trace_record import _ById, _Recorder, _Trace  # pickles: _ById
from lightning_speedkit.measure.flops import not_counted

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
        self.packed = False
        """The trace running now is of a packed batch's call, as it runs (not ahead)."""
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
        copied.packed = False
        copied.hook_id = self.hook_id  # the key under which the copied hooks sit
        for key in copied.probes:
            _PROBED[id(key.module)] = copied
        return copied

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["trace"] = state["contexts"] = None  # a trace runs in the original
        state["packed"] = False
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
            documents = _documents.active()
            # A call that checkpoints its blocks itself (transformers', diffusers' gradient
            # checkpointing) would recompute, in backward, the swaps installed at its end.
            grad = torch.is_grad_enabled()
            ahead = documents is not None or (grad and checkpoints_itself(module))
            if ahead and self._trace_ahead(module, args, kwargs, documents):
                return  # decided: the call runs what was swapped
            self.packed = documents is not None
            self._start(module)
        assert self.trace is not None
        self.trace.enter(module, args, kwargs)

    def _start(self, module: nn.Module, grad: bool | None = None) -> _Trace:
        trace = self.trace = _Trace(module, grad)
        self.contexts = contextlib.ExitStack()
        self.contexts.enter_context(force_eager())  # it must see compiled regions' calls
        # Swaps installed at the trace's end must not be what a checkpoint taken in it
        # recomputes: the kit's checkpoints run their blocks as they are meanwhile.
        self.contexts.enter_context(_surgery.forwards_changing())
        self.contexts.enter_context(checkpoints_paused(module))  # the model's own, likewise
        self.contexts.enter_context(_Recorder(trace))
        return trace

    def _stop(self) -> None:
        assert self.contexts is not None
        self.contexts.close()
        self.trace = self.contexts = None

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        trace = self.trace
        if trace is None or not trace.exit(module):
            return
        self._stop()
        packed, self.packed = self.packed, False
        found = self._finish(trace)
        if packed and found:
            self._warn_traced_as_it_ran(found)

    def _trace_ahead(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        documents: _documents.Documents | None,
    ) -> bool:
        """Trace a first call before it runs: a packed batch's, or one that checkpoints its
        blocks itself (see the module docstring).

        Returns whether it was traced (its modules decided); ``False`` leaves the call to be
        traced as it runs.
        """
        if fsdp2_units(module):
            return False  # its parameters are gathered by its own call's hooks, after this
        grad = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        copies = copy_inputs(args, kwargs, requires_grad=False)  # safe from in-place changes
        buffers = [
            (n, b, _compat.tensor_version(b))
            for n, b in module.named_buffers()
            if not b.is_inference()
        ]
        mixed = documents is not None and "mixed" in documents.seen
        trace = self._start(module, grad)
        ran = False
        try:
            with (
                torch.no_grad(),
                random_state_kept(),  # the call draws what it would have
                not_counted(),
                _surgery.side_run(),
                _norms_in_eval(module),
            ):
                trace.enter(module, *copies)
                module.forward(*copies[0], **copies[1])
            ran = True
        except Exception:
            log.debug("tracing ahead of the first call failed", exc_info=True)
        finally:
            if documents is not None and not mixed:  # the run ahead mixed the rows, not the call
                documents.seen.pop("mixed", None)
            if not ran:
                self._stop()  # the call is traced as it runs
        if not ran:
            return False
        trace.exit(module)
        self._stop()
        changed = [name for name, b, v in buffers if _compat.tensor_version(b) != v]
        forward = module.forward  # what this call runs (``__call__`` read it before its hooks)
        self._finish(trace)  # its checks may put buffers back: compared before
        if module.forward != forward and _surgery.replaced_forward(module) is not None:
            _replace_output(module, args, kwargs, mixed)  # the call itself was swapped
        if changed:
            why = "a packed batch's" if documents is not None else "checkpointing its blocks"
            _documents.warn_once(
                f"The first call of {self._name(module)!r}, {why}, was traced by "
                "running its forward once ahead of it: buffers it changes in place "
                f"({', '.join(changed)}) changed twice on that step. Call "
                "`swap_attention(model, sample=...)` before fit to trace it there."
            )
        return True

    def _name(self, module: nn.Module) -> str:
        return self.candidates.get(_ById(module), type(module).__name__) or "(root)"

    def _warn_traced_as_it_ran(self, found: list[Found]) -> None:
        names = ", ".join(repr(self._name(item.owner)) for item in found)
        _documents.warn_once(
            f"Tracing found attention in {names} on its first call, a packed batch's, which "
            "could not be traced ahead of itself: that call ran the module's own attention "
            "over whole rows, across the documents of a row (later calls keep them apart). "
            "Call `swap_attention(model, sample=...)` on an unpacked sample before fit, or "
            "make the first batch unpacked."
        )

    def _finish(self, trace: _Trace) -> list[Found]:
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
        return found


def _replace_output(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], mixed: bool
) -> None:
    """The call now running took the module's own forward before its pre-hooks swapped it
    (``nn.Module.__call__`` reads ``forward`` first): its output is replaced by the swap's,
    run on the same inputs from the same random state (a hook of this call only)."""
    devices = {t.device for t in _tensor_args(args, kwargs) if t.device.type == "cuda"}
    states = [(d, torch.cuda.get_rng_state(d)) for d in devices]
    cpu = torch.get_rng_state()
    handles: list[Any] = []

    def swapped(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        handles.pop().remove()
        if output is None:
            return None  # the call raised: nothing to replace
        documents = _documents.active()
        if documents is not None and not mixed:
            documents.seen.pop("mixed", None)
        torch.set_rng_state(cpu)
        for device, state in states:
            torch.cuda.set_rng_state(state, device)
        with not_counted(), _documents.sdpa_per_document():
            return module.forward(*args, **kwargs)

    handles.append(module.register_forward_hook(swapped, with_kwargs=True, always_call=True))


@contextlib.contextmanager
def _norms_in_eval(module: nn.Module) -> Iterator[None]:
    """Norms that keep running statistics (batch norms; instance norms asked to) in eval
    mode inside: a run ahead updates none (nor syncs them across ranks)."""
    norms = [m for m in module.modules() if getattr(m, "track_running_stats", None) is True]
    norms = [m for m in norms if m.training]
    for norm in norms:
        norm.training = False
    try:
        yield
    finally:
        for norm in norms:
            norm.training = True


#: id(module) -> the discovery probing it (a module is probed once). Weak: a discovery
#: lives as long as the hooks of its modules hold it.
_PROBED: weakref.WeakValueDictionary[int, Discovery] = weakref.WeakValueDictionary()


def probed(module: nn.Module) -> bool:
    """Whether a discovery awaits this module's first call."""
    discovery = _PROBED.get(id(module))
    return discovery is not None and _ById(module) in discovery.probes
