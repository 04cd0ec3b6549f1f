"""The loader's half of the frozen-feature cache: a served sample comes without its inputs.

Once every cached module has a sample's features stored (and, with ``verify``, checked),
the training step no longer needs that sample's inputs to those modules: they are served,
not computed. A map-style dataset that can build a sample without some of its fields says
so by defining one method::

    def speedkit_getitem(self, index: int, without: frozenset[str]) -> Any:
        '''Sample ``index`` with each field in ``without`` a cheap stand-in of the same
        shape and dtype (``torch.zeros``): its image not read, not decoded.'''

and the loader then asks it for the sample that way. By defining it the dataset vouches
that the fields it is asked to leave out are read by nothing but the modules the cache
serves (the cache itself checks that each is the cached module's input as the batch
carries it).

Which samples are ready, and which fields to leave out, are decided in the training
process and read by the loader's worker processes, forked or spawned: both live in
shared memory (:class:`SkipPlan`). A batch says which of its rows are stand-ins
(``SampleIndex.stand_ins``). Should a cached module have to run on a stand-in row (its
features were dropped, or the cache stood down, after the loader had already built the
batch), the real inputs of those rows are read again in the training process first
(:func:`refetch_field`): a stand-in never reaches a module.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset, default_collate

from lightning_speedkit.compute._frozen_layout import loader_keeps_inputs

if TYPE_CHECKING:
    from lightning_speedkit.compute._frozen_call import CachedModule, Scope

__all__ = ["LoaderPlan", "SkipPlan", "can_skip", "refetch_field"]

#: Bytes of shared memory for the names of the fields left out (JSON).
_NAME_BYTES = 1024


def can_skip(dataset: Any) -> bool:
    """Whether ``dataset`` builds a sample without some fields (``speedkit_getitem``)."""
    return callable(getattr(dataset, "speedkit_getitem", None))


class SkipPlan:
    """Which samples come without which fields: flags and names in shared memory.

    The training process marks samples ready and names the fields; a loader worker asks
    :meth:`without` for each sample it builds.

    Example::

        >>> plan = SkipPlan(4)
        >>> plan.without(2)
        frozenset()
        >>> plan.set_fields(["images"])
        True
        >>> plan.mark([2, 3])
        >>> plan.without(2), plan.without(0), plan.ready_count()
        (frozenset({'images'}), frozenset(), 2)
    """

    def __init__(self, size: int) -> None:
        self.ready = torch.zeros(size, dtype=torch.bool).share_memory_()
        self._names = torch.zeros(_NAME_BYTES, dtype=torch.uint8).share_memory_()
        self._read: tuple[bytes, frozenset[str]] = (b"", frozenset())

    def set_fields(self, fields: Iterable[str]) -> bool:
        """Name the fields to leave out; False (nothing left out) if the names do not fit."""
        data = json.dumps(sorted(fields)).encode()
        if len(data) >= _NAME_BYTES:
            return False
        names = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
        names[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._names.copy_(names)
        return True

    def fields(self) -> frozenset[str]:
        raw = self._names.numpy().tobytes().rstrip(b"\0")
        if raw != self._read[0]:
            self._read = (raw, frozenset(json.loads(raw)) if raw else frozenset())
        return self._read[1]

    def mark(self, indices: Sequence[int]) -> None:
        """These samples' features are stored and checked: build them without the fields."""
        if indices:
            self.ready[torch.as_tensor(list(indices), dtype=torch.long)] = True

    def clear(self) -> None:
        """No sample is ready any more (the cache stood down, or dropped features)."""
        self.ready.zero_()

    def ready_count(self) -> int:
        return int(self.ready.sum())

    def without(self, index: int) -> frozenset[str]:
        """The fields to leave out of sample ``index`` (none until it is ready)."""
        if not 0 <= index < len(self.ready) or not bool(self.ready[index]):
            return frozenset()
        return self.fields()


class LoaderPlan:
    """The training process's side of a :class:`SkipPlan`: after each step, which samples
    the loader may now build without the cached modules' inputs."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.plan: SkipPlan | None = None
        self.primed = False  # the plan holds every sample ready before it was given
        self.drops = 0  # the modules' drops of stored features the plan has taken in

    def use(self, plan: SkipPlan | None) -> None:
        self.plan, self.primed = plan, False

    def update(self, cached: list[CachedModule], keys: Sequence[Hashable]) -> None:
        """Mark the samples every module has stored (and checked), when each module's
        input is a batch field; clear the plan when features were dropped."""
        plan = self.plan
        if plan is None:
            return
        drops = sum(c.drops for c in cached)
        if drops != self.drops:  # features dropped: those samples need their inputs again
            self.drops, self.primed = drops, False
            plan.clear()
        serving = bool(cached) and all(
            c.counts.stood_down is None and (c.verified or not self.scope.verify) for c in cached
        )
        for c in cached if serving else ():
            if c.slots and c.sources is None:  # called, on an input made in the model
                self.scope.warn_once(loader_keeps_inputs(c.name))
        if not serving or any(c.sources is None for c in cached):
            if plan.ready_count():
                plan.clear()
            self.primed = False
            return
        if not self.primed:  # newly usable (checked, or a new loader): all stored so far
            self.primed = plan.set_fields({str(f) for c in cached for f in c.sources or ()})
            keys = list(set.intersection(*(c.ready for c in cached)))
        ready = [k for k in keys if all(c.holds(k) for c in cached)]
        plan.mark([int(k) for k in ready if isinstance(k, int)])


def refetch_field(
    dataset: Dataset[Any],
    collate_fn: Callable[[list[Any]], Any] | None,
    transfer: Callable[[Any], Any] | None = None,
) -> Callable[[Sequence[Hashable], Hashable], Any]:
    """A reader of real inputs: ``read(indices, field)`` builds those samples in full and
    returns the collated batch's ``field`` (a key of a dict batch, a position in a list),
    after ``transfer``: what happens to a batch between the loader and the step (the
    Trainer's batch hooks, the move to the device), so that the rows read again are what
    the step would have had."""
    collate = collate_fn or default_collate

    def read(indices: Sequence[Hashable], field: Hashable) -> Any:
        batch = collate([dataset[int(i)] for i in indices])  # type: ignore[call-overload]
        if transfer is not None:
            batch = transfer(batch)
        return batch[field]

    return read
