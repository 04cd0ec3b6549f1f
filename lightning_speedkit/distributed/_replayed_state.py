"""What a checkpointed block's recomputation sees and leaves: its state as the forward had it.

The recomputation in backward runs the block's forward a second time. Whatever that
forward changes besides its output would change twice per step: a buffer updated in
place (batch norm's running statistics, an MoE router's expert load, ``self.steps += 1``),
a buffer reassigned (``self.ema = 0.9 * self.ema + ...``), a plain Python counter
(``self.calls += 1``). And it would run on the state the forward left, not the state it
found: a forward whose output reads a buffer it then updates would give other outputs.

:class:`CallState` is taken at each checkpointed call, before its forward. The
recomputation runs with the block's buffers and plain counters as they were then, and
they are put back as they were before it (the forward's, or a later call's of a block
called several times per step) when it ends.

Cheap, because what a walk of the block finds is learned once, at its first call, and
kept per block (a plan): where its buffers are (``owner.name``) and which attributes of
each module hold a counter. A later call reads just those: each buffer slot's tensor and
version counter, and each module's counters by name (one ``itemgetter``, no scan of its
attributes); the recomputation restores only the counters that differ. The plan is
learned again after a submodule or a new buffer name is registered on a module of the
block (:mod:`lightning_speedkit._module_tree`), and a module's counter names are read again when
it gains or loses an attribute. Only a buffer the block's forward changes in place is
copied, each call; which those are is learned at the block's first call (its tensors'
version counters before and after), where every buffer is copied once; a norm layer's
running statistics, which its kernel updates without counting a version, are copied each
call. Constant buffers (causal masks, rotary caches) are not copied again.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_speedkit import _compat, _module_tree
from lightning_speedkit._counters import is_counter

__all__ = ["CallState"]

log = logging.getLogger(__name__)

#: Per block: the buffers (qualified names within it) its forward changes in place.
_CHANGED_IN_PLACE: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = (
    weakref.WeakKeyDictionary()
)
_WARNED: set[str] = set()
_ABSENT = object()
_ATTRS = operator.attrgetter("__dict__")  # ``vars(module)``, typed as the dict it is


def _call_py(function: Callable[..., Any], *args: Any) -> Any:
    return function(*args)


#: ``function(*args)``, in C from Python 3.11 (mapped over a block's modules each call).
_call: Callable[..., Any] = getattr(operator, "call", _call_py)


def _version(tensor: torch.Tensor) -> int | None:
    """The version counter; None for an inference tensor, which has none (and which no
    forward outside inference mode can change in place)."""
    return None if tensor.is_inference() else _compat.tensor_version(tensor)


@dataclass(frozen=True)
class _Slot:
    """Where a buffer lives: ``owner.name``, ``key`` within the block."""

    owner: weakref.ref[nn.Module]  # weak: the plan is kept per block, the block may own it
    name: str
    key: str
    stats: bool  # a norm layer's running statistics: changed, though no version counter shows it


#: Reads the named attributes of a module, from its ``vars()``, as a tuple.
_Getter = Callable[[dict[str, Any]], tuple[Any, ...]]


def _counter_names(attrs: dict[str, Any]) -> tuple[tuple[str, ...], _Getter]:
    """The names of the counters in a module's attributes (and of those holding None, which
    may become one), and what reads their values."""
    names = tuple(k for k, v in attrs.items() if v is None or is_counter(v))
    if len(names) > 1:
        return names, operator.itemgetter(*names)
    if names:
        name = names[0]
        return names, lambda attrs: (attrs[name],)
    return names, lambda attrs: ()


@dataclass
class _Plan:
    """What a walk of a block finds, learned at its first call. The counters' lists are
    parallel, one entry per module, and replaced (not changed) when a module's names are
    read again: a CallState taken before keeps the ones it read."""

    structure: int  # the module tree's generation then
    slots: list[_Slot]
    modules: list[weakref.ref[nn.Module]]  # weak: the plan is kept per block
    sizes: list[int]  # how many attributes each had: another number, read the names again
    names: list[tuple[str, ...]]
    getters: list[_Getter]


_PLANS: weakref.WeakKeyDictionary[nn.Module, _Plan] = weakref.WeakKeyDictionary()


def _plan(block: nn.Module, *, again: bool = False) -> _Plan:
    plan = _PLANS.get(block)
    if plan is None or again or plan.structure != _module_tree.generation():
        slots = []
        for prefix, owner in block.named_modules():
            stats = _has_running_stats(owner)
            for name, _ in owner.named_buffers(recurse=False):
                key = f"{prefix}.{name}" if prefix else name
                slots.append(_Slot(weakref.ref(owner), name, key, stats))
        modules = list(block.modules())
        structure = _module_tree.watch(modules)
        names, getters = zip(*(_counter_names(m.__dict__) for m in modules), strict=True)
        sizes = [len(m.__dict__) for m in modules]
        refs = [weakref.ref(m) for m in modules]
        plan = _Plan(structure, slots, refs, sizes, list(names), list(getters))
        _PLANS[block] = plan
    return plan


@dataclass
class _Found:
    """A buffer slot at the call: the tensor the forward found in it."""

    slot: _Slot
    owner: nn.Module
    tensor: torch.Tensor
    version: int | None
    value: torch.Tensor | None  # its value then, copied where the forward may change it


class CallState:
    """The buffers and counters of ``block`` before one checkpointed call of its forward.

    Take it before the call, :meth:`learn` after it, and run the recomputation inside
    :meth:`replayed`.
    """

    def __init__(self, block: nn.Module) -> None:
        self._block = block
        known = _CHANGED_IN_PLACE.get(block)  # None: the first call, which copies them all
        plan = _plan(block)
        found = _buffers(plan, known)
        if found is None:  # a slot emptied, or its module gone: the block is walked again
            plan = _plan(block, again=True)
            found = _buffers(plan, known) or []
        self._found = found
        counters = _counters(plan)
        if counters is None:  # a module gone
            counters = _counters(_plan(block, again=True)) or ([], [], [], [])
        self._names, self._getters, self._attrs, self._values = counters

    def learn(self) -> None:
        """After the forward: remember which buffers it changed in place, and drop the
        copies of those it did not change (every buffer's, at the first call)."""
        known = _CHANGED_IN_PLACE.get(self._block)
        changed = {f.slot.key for f in self._found if _changed(f)}
        late = sorted(changed - known) if known is not None else []
        known = (known or frozenset()) | changed
        _CHANGED_IN_PLACE[self._block] = known
        for f in self._found:
            if f.slot.key not in known:
                f.value = None
        if late:
            _warn_late(type(self._block).__name__, late)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """The recomputation: the block's buffers and counters as its forward found them,
        then as they were before it."""
        now = [getattr(f.owner, f.slot.name, None) for f in self._found]
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the values written over
        with torch.no_grad() if self._found else contextlib.nullcontext():
            for f in self._found:
                if _changed(f) and id(f.tensor) not in kept:
                    kept[id(f.tensor)] = (f.tensor, f.tensor.detach().clone())
                    if f.value is not None:  # else changed where it was not seen before
                        f.tensor.copy_(f.value)
                if getattr(f.owner, f.slot.name, None) is not f.tensor:  # reassigned
                    setattr(f.owner, f.slot.name, f.tensor)
        counters = _counters_replayed(self._names, self._getters, self._attrs, self._values)
        try:
            yield
        finally:
            with torch.no_grad() if kept else contextlib.nullcontext():
                for tensor, value in kept.values():
                    tensor.copy_(value)
            for f, buffer in zip(self._found, now, strict=True):
                if getattr(f.owner, f.slot.name, None) is not buffer:
                    setattr(f.owner, f.slot.name, buffer)
            for attrs, values in counters:
                attrs.update(values)


def _buffers(plan: _Plan, known: frozenset[str] | None) -> list[_Found] | None:
    """Each buffer slot's tensor and version now, copied where the forward may change it in
    place (every one while ``known`` is None); None if a slot no longer holds a tensor."""
    found: list[_Found] = []
    with torch.no_grad() if plan.slots else contextlib.nullcontext():
        for slot in plan.slots:
            owner = slot.owner()
            tensor = getattr(owner, slot.name, None) if owner is not None else None
            if owner is None or not isinstance(tensor, torch.Tensor):
                return None
            version = _version(tensor)
            copy = slot.stats or (version is not None and (known is None or slot.key in known))
            value = tensor.detach().clone() if copy else None
            found.append(_Found(slot, owner, tensor, version, value))
    return found


def _counters(
    plan: _Plan,
) -> tuple[list[tuple[str, ...]], list[_Getter], list[dict[str, Any]], list[Any]] | None:
    """Each module's counters now, by the names the plan has (read again for a module that
    gained or lost an attribute): names, getters, attributes, values; None if a module is
    gone. The common case is a few loops in C, not one per module in Python."""
    try:
        attrs: list[dict[str, Any]] = list(map(_ATTRS, map(_call, plan.modules)))
    except AttributeError:  # ``None.__dict__``: a module gone
        return None
    try:
        if list(map(len, attrs)) != plan.sizes:
            raise KeyError
        values = list(map(_call, plan.getters, attrs))
    except KeyError:  # an attribute added, or one deleted and another added
        names, getters = list(plan.names), list(plan.getters)
        for i, own in enumerate(attrs):
            if len(own) != plan.sizes[i] or not set(names[i]) <= own.keys():
                names[i], getters[i] = _counter_names(own)
        plan.names, plan.getters, plan.sizes = names, getters, list(map(len, attrs))
        values = list(map(_call, getters, attrs))
    return plan.names, plan.getters, attrs, values


def _counters_replayed(
    names: list[tuple[str, ...]],
    getters: list[_Getter],
    attrs: list[dict[str, Any]],
    values: list[Any],
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The counters put back as they were at the call (those that differ now); returns
    what to put back after the recomputation, per module."""
    try:
        current = list(map(_call, getters, attrs))
    except KeyError:  # one was deleted
        current = [tuple(a.get(k, _ABSENT) for k in n) for n, a in zip(names, attrs, strict=True)]
    flat = itertools.chain.from_iterable
    if all(map(operator.is_, flat(current), flat(values))):  # the same objects: unchanged
        return []
    restored = []
    for own, keys, before, now in zip(attrs, names, values, current, strict=True):
        differ = {k: b for k, b, n in zip(keys, before, now, strict=True)
                  if n is not b and _restored(n, b)}  # fmt: skip
        if differ:
            restored.append((own, {k: own[k] for k in differ if k in own}))
            own.update(differ)
    return restored


def _changed(found: _Found) -> bool:
    return found.slot.stats or (
        found.version is not None and _version(found.tensor) != found.version
    )


def _restored(now: Any, before: Any) -> bool:
    """Whether the recomputation gets ``before`` back: a counter that changed (or became
    one); one that became something else (a tensor) is not compared, which could sync the
    device."""
    if not (is_counter(before) or (before is None and is_counter(now))):
        return False
    return type(now) is not type(before) or now != before


def _has_running_stats(module: nn.Module) -> bool:
    """Batch norm, or instance norm with ``track_running_stats``, in train mode updates its
    running statistics inside its kernel, which does not count a version of them."""
    return bool(getattr(module, "track_running_stats", False)) and (
        getattr(module, "running_mean", None) is not None
    )


def _warn_late(block: str, keys: list[str]) -> None:
    message = (
        f"ActivationCheckpointing: a {block}'s forward changed the buffers {keys} in place "
        f"for the first time after its first call; that call's recomputation saw them "
        f"updated (their values after the step are right). From now on they are kept "
        f"for it."
    )
    if message not in _WARNED:
        _WARNED.add(message)
        rank_zero_warn(message)
