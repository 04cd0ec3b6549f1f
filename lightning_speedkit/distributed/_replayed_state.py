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
called several times per step) when it ends. Cheap: a buffer the forward reassigns is
kept by reference; only a buffer the block's forward changes in place is copied, each
call, and which those are is learned at the block's first call (its tensors' version
counters before and after), where every buffer is copied once; a norm layer's running
statistics, which its kernel updates without counting a version, are copied each call.
Constant buffers (causal masks, rotary caches) are not copied again.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_speedkit import _compat

__all__ = ["CallState"]

log = logging.getLogger(__name__)

#: Per block: the buffers (qualified names within it) its forward changes in place.
_CHANGED_IN_PLACE: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = (
    weakref.WeakKeyDictionary()
)
_WARNED: set[str] = set()
_ABSENT = object()


def _version(tensor: torch.Tensor) -> int | None:
    """The version counter; None for an inference tensor, which has none (and which no
    forward outside inference mode can change in place)."""
    return None if tensor.is_inference() else _compat.tensor_version(tensor)


def _counters(module: nn.Module) -> dict[str, Any]:
    """The module's plain Python numbers and flags (``self.calls``, ``self.training``)."""
    return {k: v for k, v in vars(module).items() if type(v) in (int, float, bool)}


@dataclass
class _Slot:
    owner: nn.Module
    name: str
    key: str
    tensor: torch.Tensor  # the buffer the forward found in the slot
    version: int | None
    value: torch.Tensor | None  # its value then, copied where the forward may change it
    stats: bool  # a norm layer's running statistics: changed, though no version counter shows it


class CallState:
    """The buffers and counters of ``block`` before one checkpointed call of its forward.

    Take it before the call, :meth:`learn` after it, and run the recomputation inside
    :meth:`replayed`.
    """

    def __init__(self, block: nn.Module) -> None:
        self._block = block
        known = _CHANGED_IN_PLACE.get(block)  # None: the first call, which copies them all
        self._slots: list[_Slot] = []
        with torch.no_grad():
            for prefix, owner in block.named_modules():
                stats = _has_running_stats(owner)
                for name, buffer in owner.named_buffers(recurse=False):
                    key = f"{prefix}.{name}" if prefix else name
                    version = _version(buffer)
                    copy = stats or (version is not None and (known is None or key in known))
                    value = buffer.detach().clone() if copy else None
                    self._slots.append(_Slot(owner, name, key, buffer, version, value, stats))
        self._counters = [(m, _counters(m)) for m in block.modules()]

    def learn(self) -> None:
        """After the forward: remember which buffers it changed in place, and drop the
        copies of those it did not change (every buffer's, at the first call)."""
        known = _CHANGED_IN_PLACE.get(self._block)
        changed = {s.key for s in self._slots if _changed(s)}
        late = sorted(changed - known) if known is not None else []
        known = (known or frozenset()) | changed
        _CHANGED_IN_PLACE[self._block] = known
        for slot in self._slots:
            if slot.key not in known:
                slot.value = None
        if late:
            _warn_late(type(self._block).__name__, late)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """The recomputation: the block's buffers and counters as its forward found them,
        then as they were before it."""
        now = [getattr(s.owner, s.name, None) for s in self._slots]
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the values written over
        with torch.no_grad():
            for slot in self._slots:
                if _changed(slot) and id(slot.tensor) not in kept:
                    kept[id(slot.tensor)] = (slot.tensor, slot.tensor.detach().clone())
                    if slot.value is not None:  # else changed where it was not seen before
                        slot.tensor.copy_(slot.value)
                if getattr(slot.owner, slot.name, None) is not slot.tensor:  # reassigned
                    setattr(slot.owner, slot.name, slot.tensor)
        counters: list[tuple[nn.Module, dict[str, Any]]] = []
        for module, before in self._counters:
            current = vars(module)
            differ = {k: v for k, v in before.items() if _differs(current.get(k, _ABSENT), v)}
            if differ:
                counters.append((module, {k: current[k] for k in differ if k in current}))
                current.update(differ)
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, value in kept.values():
                    tensor.copy_(value)
            for slot, buffer in zip(self._slots, now, strict=True):
                if getattr(slot.owner, slot.name, None) is not buffer:
                    setattr(slot.owner, slot.name, buffer)
            for module, values in counters:
                vars(module).update(values)


def _changed(slot: _Slot) -> bool:
    return slot.stats or (slot.version is not None and _version(slot.tensor) != slot.version)


def _differs(now: Any, before: Any) -> bool:
    """Whether a counter changed; one that became something else (a tensor) is not
    compared, which could sync the device."""
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
