"""One cached module: its forward, while batch keys are set, serves stored samples.

The module's ``forward`` is replaced on the instance (its class, parameters, hooks and
``state_dict`` keys stay as they are); :meth:`CachedModule.detach` puts it back. For each
call while the owner's keys are set: the samples stored under the module's weights
fingerprint are served from the store and do not run; the others (the misses) are
gathered, run once, stored, and scattered back into the batch's order. A batch with no
stored sample runs as it came, so the first epoch is the plain run's, bit for bit.

A module called more than once in a step (two images per sample, a view computed in the
model) keeps one :class:`Slot` of features per kind of call: a call on a batch field is
known by the field, any other by its place among such calls in the step. Each slot is
checked on its first reuse, as a module called once is.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_speedkit import _compat
from lightning_speedkit._surgery import in_side_run, note_served_flops
from lightning_speedkit.compute._frozen_layout import (
    NO_ROW,
    ROWS_UNCHECKED,
    FieldLayout,
    why_not_rows,
)
from lightning_speedkit.compute._frozen_modules import (
    ModuleWeights,
    RandomDraws,
    Stamp,
    _chance_layers,
    attributes_changed,
    drawn_input,
    fingerprint,
    mismatch,
    why_not_now,
)
from lightning_speedkit.compute._frozen_rows import (
    OutputLayout,
    assemble,
    batch_field,
    call_signature,
    cut_rows,
    first_row,
    same_tensor,
)
from lightning_speedkit.compute._frozen_store import FeatureStore
from lightning_speedkit.measure.flops import model_flops_so_far

__all__ = ["CachedModule", "Scope", "Slot"]


@dataclass
class Scope:
    """What every cached module of one cache shares: the store, the step's keys, settings.

    ``fields`` are the step's batch tensors by field (a dict batch's key, a list batch's
    position); ``stand_ins`` the rows whose inputs the loader left out (:mod:`._frozen_skip`)
    and ``refetch(keys, field)`` what reads their real inputs again. ``data`` is the
    dataset's fingerprint (empty when the keys identify samples by themselves), and
    ``drawn`` the sample fields its two reads of a sample disagreed on (random).
    ``layouts``: how the loader's collate made each field from the samples (None when not
    seen: no Trainer, or ``key="<field>"``), and ``seen`` the tensors the model was called
    with in a step given no batch (:mod:`._frozen_layout`).
    """

    store: FeatureStore
    dtype: torch.dtype | None
    verify: bool
    keys: Sequence[Hashable] | None = None
    warned: set[str] = field(default_factory=set)
    fields: dict[Hashable, torch.Tensor] = field(default_factory=dict)
    stand_ins: Sequence[int] = ()
    refetch: Callable[[Sequence[Hashable], Hashable], Any] | None = None
    data: str = ""
    drawn: set[Hashable] = field(default_factory=set)
    layouts: dict[Hashable, FieldLayout] | None = None
    seen: dict[Hashable, torch.Tensor] = field(default_factory=dict)

    def warn_once(self, message: str, key: str | None = None) -> None:
        """Say ``message`` once (once per ``key``, when given)."""
        if (key or message) not in self.warned:
            self.warned.add(key or message)
            rank_zero_warn(message)


@dataclass
class ModuleCounts:
    """Per-module counters: samples served, run (and stored or not), calls not served."""

    hits: int = 0
    misses: int = 0
    stored: int = 0
    not_stored: int = 0
    plain_calls: int = 0
    refetched: int = 0
    verified: bool = False
    stood_down: str | None = None


@dataclass
class Slot:
    """One kind of call of a module within a step, and the features stored for it.

    ``source``: the batch field the call's input is (as the batch has it), or None for an
    input computed in the model, then told apart by its place among those calls (``key``).
    """

    key: Hashable
    source: Hashable | None
    ready: set[Hashable] = field(default_factory=set)  # keys stored under current weights
    verified: bool = False
    #: Its output's layout by what else it is called with: one field read with other
    #: arguments (``output_hidden_states=True``) may give another structure.
    layouts: dict[Hashable, OutputLayout] = field(default_factory=dict)
    flops_per_row: float | None = None  # its forward's model FLOPs per sample, counted
    draws_checked: bool = False  # a call was seen to draw no random number (RandomDraws)


class CachedModule:
    """``module``'s forward with the store in front of it (see the module docstring)."""

    def __init__(self, name: str, module: nn.Module, scope: Scope) -> None:
        self.name, self.module, self.scope = name, module, scope
        self.counts = ModuleCounts()
        self.slots: dict[Hashable, Slot] = {}
        self._unnamed = 0  # calls in the current step whose input is not a batch field
        self._chance = _chance_layers(module)
        self._weights = ModuleWeights(module)
        self._stamp: Stamp | None = None
        self._fingerprint = ""
        self.original = module.forward
        self.drops = 0  # times its stored features were dropped (weights changed, stood down)
        #: Model FLOPs per sample of a call on a batch field, counted before it was cached
        #: (``"auto"`` finds it in a step SpeedMonitor may count): what a served row saves.
        self.flops_hints: dict[Hashable, float] = {}

    def new_step(self) -> None:
        self._unnamed = 0

    @property
    def sources(self) -> list[Hashable] | None:
        """The batch fields its calls read (None when one reads an input made in the model,
        or before its first call): what the loader may leave out of a served sample."""
        sources = [slot.source for slot in self.slots.values()]
        return None if not sources or None in sources else sources

    @property
    def ready(self) -> set[Hashable]:
        """The samples every slot has stored (and may serve), as a new set: ask
        :meth:`holds` of a step's few keys."""
        slots = [s.ready for s in self.slots.values()]
        return set.intersection(*slots) if slots else set()

    def holds(self, key: Hashable) -> bool:
        """Whether every slot has ``key`` stored."""
        return bool(self.slots) and all(key in s.ready for s in self.slots.values())

    @property
    def verified(self) -> bool:
        return bool(self.slots) and all(slot.verified for slot in self.slots.values())

    def forget(self, keys: set[Hashable] | None = None) -> None:
        """``keys`` (all when None) are no longer stored for any slot."""
        for slot in self.slots.values():
            if keys is None:
                slot.ready.clear()
            else:
                slot.ready -= keys

    def attach(self) -> None:
        self.original = self.module.forward
        self.module.forward = self.forward
        self.module._speedkit_frozen = self  # type: ignore[assignment]

    def recheck_weights(self) -> None:
        """Fingerprint the weights again at the next call: a write through ``p.data``
        (an EMA teacher's update, as DINO and MoCo write it) changes no version counter
        the cheap stamp reads."""
        self._stamp = None

    def detach(self) -> None:
        vars(self.module).pop("forward", None)
        vars(self.module).pop("_speedkit_frozen", None)

    def stand_down(self, reason: str, wrong: bool = False) -> None:
        """Stop serving for good: forget the stored features and say why, once. ``wrong``:
        they proved wrong, and their disk shards go too."""
        self.counts.stood_down = reason
        if wrong:
            self.scope.store.reject(self.name)
        else:
            self.scope.store.drop(where=self.name)
        self.forget()
        self.drops += 1
        self.scope.warn_once(f"FrozenFeatureCache stopped serving `{self.name}`: {reason}.")

    # -- the call -----------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        keys = self.scope.keys
        if keys is None or in_side_run():  # no step, or the kit's check beside the step
            return self.original(*args, **kwargs)
        slot = self._slot(args, kwargs)
        if slot.source in self.scope.drawn and self.counts.stood_down is None:
            self.stand_down(drawn_input(slot.source))
        if self.counts.stood_down is not None:
            return self._run(args, kwargs, slot=slot)
        signature, why = call_signature(args, kwargs, len(keys))
        stamp = self._weights.stamp()  # one walk of the weights: trainable? changed?
        why = why or why_not_now(self.name, self.module, self._chance) or self._trainable(stamp)
        if why is not None:
            self.counts.plain_calls += 1
            once = f"{self.name} {NO_ROW}" if NO_ROW in why else None  # any batch shape: once
            message = f"FrozenFeatureCache runs `{self.name}` without the store: {why}."
            self.scope.warn_once(message, once)
            return self._run(args, kwargs, slot=slot)
        if self._misaligned(args, kwargs, slot):
            return self._run(args, kwargs, slot=slot)
        base = self._base(stamp, signature, slot)
        found = [self.scope.store.get((*base, key)) for key in keys]
        hit = [i for i, entry in enumerate(found) if entry is not None]
        miss = [i for i, entry in enumerate(found) if entry is None]
        check = bool(hit) and self.scope.verify and not slot.verified
        if not hit or check or signature not in slot.layouts or not slot.draws_checked:
            out = self._run(args, kwargs, slot=slot, first=not slot.draws_checked)  # as plain
            if not slot.draws_checked:  # its forward drew random numbers: stood down
                return out
            leaves = self._leaves(out, len(keys), slot, signature)
            if leaves is not None and (not check or self._check(leaves, found, hit, slot)):
                self._keep(leaves, base, [keys[i] for i in miss], miss, slot)
                slot.ready.update(keys[i] for i in hit)
            return out
        computed = None
        if miss:
            computed = self._run(args, kwargs, miss, slot)
            leaves = self._leaves(computed, len(miss), slot, signature)
            if leaves is None:
                return self._run(args, kwargs, slot=slot)
            self._keep(leaves, base, [keys[i] for i in miss], list(range(len(miss))), slot)
            computed = leaves[0]
        self.counts.hits += len(hit)
        slot.ready.update(keys[i] for i in hit)  # also those found on disk
        if slot.flops_per_row is not None:  # a FLOP count of this step must leave them out
            note_served_flops(slot.flops_per_row * len(hit))
        return assemble(found, hit, miss, computed, len(keys), slot.layouts[signature])

    def take(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Store what a call that ran before the module was cached computed (the step in
        which ``"auto"`` found it), as a first call stores its misses: those samples are
        then never run again a few rows apart, whose last bits a convolution's or matrix
        product's kernels may compute otherwise than a whole batch's."""
        keys = self.scope.keys
        if keys is None or self.counts.stood_down is not None:
            return
        slot = self._slot(args, kwargs)
        if slot.source in self.scope.drawn:
            return  # its next call stands down
        signature, why = call_signature(args, kwargs, len(keys))
        stamp = self._weights.stamp()
        if why or why_not_now(self.name, self.module, self._chance) or self._trainable(stamp):
            return  # its next call runs it as it is, and says why
        if self._misaligned(args, kwargs, slot):
            return
        base = self._base(stamp, signature, slot)
        miss = [i for i, key in enumerate(keys) if self.scope.store.get((*base, key)) is None]
        leaves = self._leaves(out, len(keys), slot, signature)
        if leaves is not None:
            slot.draws_checked = True  # the step that found it saw its calls draw nothing
            self._keep(leaves, base, [keys[i] for i in miss], miss, slot)

    def _misaligned(self, args: tuple[Any, ...], kwargs: dict[str, Any], slot: Slot) -> bool:
        """Whether the batch shows that the call's rows may not be its samples in order (and
        then stand down for good: its rows are images, or cannot be told apart)."""
        scope = self.scope
        fields, of = (
            (scope.fields, "the batch's") if scope.fields else (scope.seen, "the model's input")
        )
        inputs, rows = [*args, *kwargs.values()], len(scope.keys or ())
        why = why_not_rows(slot.source, inputs, fields, scope.layouts, rows, of)
        if why is not None:
            self.stand_down(why)
        return why is not None

    def _base(self, stamp: Stamp, signature: Hashable, slot: Slot) -> tuple[Hashable, ...]:
        """The store key of this call's features, but the sample's key."""
        dtype = str(self.scope.dtype or "as computed")
        fingerprint = self._weights_fingerprint(stamp)
        return (self.name, fingerprint, signature, self.scope.data, dtype, slot.key)

    def _slot(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Slot:
        """This call's slot: by the batch field it reads, else by its place in the step
        among calls on inputs made in the model."""
        source = self._batch_field(args, kwargs)
        if source is not None:
            key: Hashable = ("field", source)
        else:
            key, self._unnamed = ("call", self._unnamed), self._unnamed + 1
        slot = self.slots.get(key)
        if slot is None:  # a fit resumed as checked has its first slot checked
            verified = self.counts.verified and not self.slots
            slot = self.slots[key] = Slot(key, source, verified=verified)
            slot.flops_per_row = self.flops_hints.get(source) if source is not None else None
        return slot

    def _run(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        rows: list[int] | None = None,
        slot: Slot | None = None,
        first: bool = False,
    ) -> Any:
        """The module's own forward on ``rows`` of the batch (all when None), with the real
        inputs of any stand-in row among them read again first. ``first``: the slot's first
        call, which stands the module down if it draws random numbers."""
        keys, stand = self.scope.keys, self.scope.stand_ins
        if keys is not None and stand and (rows is None or set(rows) & set(stand)):
            args, kwargs = self._real_inputs(args, kwargs, keys, slot)
        # A lone row runs beside a copy of itself: math libraries compute one row with other
        # kernels (a matrix-vector product, a single-image convolution) than a batch, whose
        # last bits differ from the whole batch's.
        lone = rows is not None and len(rows) == 1 and keys is not None and len(keys) > 1
        if rows is not None and keys is not None:
            cut = rows * 2 if lone else rows
            args, kwargs = cut_rows(args, cut, len(keys)), cut_rows(kwargs, cut, len(keys))
        before = model_flops_so_far()  # under a FLOP count: learn what a row costs
        draws = RandomDraws(self.module, args, kwargs) if first else None
        out = self.original(*args, **kwargs)
        after = model_flops_so_far()
        if draws is not None and slot is not None:
            why = draws.why()
            slot.draws_checked = why is None
            if why is not None:
                self.stand_down(why)
        run = len(rows) * (2 if lone else 1) if rows is not None else len(keys or ())
        if slot is not None and before is not None and after is not None and run:
            slot.flops_per_row = (after - before) / run
        return first_row(out) if lone else out

    def _batch_field(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable | None:
        return batch_field(self.scope.fields, [*args, *kwargs.values()])

    def _real_inputs(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        keys: Sequence[Hashable],
        slot: Slot | None,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args`` and ``kwargs`` with the stand-in rows of the batch field filled in."""
        stand = list(self.scope.stand_ins)
        source = slot.source if slot is not None else None
        tensor = self.scope.fields.get(source) if source is not None else None
        if tensor is None or self.scope.refetch is None:
            raise RuntimeError(
                f"FrozenFeatureCache: `{self.name}` must run on rows whose inputs the loader "
                f"left out, and its input is not a batch field it can read again"
            )
        layouts = self.scope.layouts
        laid = layouts.get(source) if layouts is not None else None
        if laid is None or laid.counts == (1,) * len(keys):
            real = self.scope.refetch([keys[i] for i in stand], source)
            whole = tensor.clone()
            whole[torch.tensor(stand, device=whole.device)] = real.to(whole.device, whole.dtype)
        else:  # its rows are not the samples: the whole field, every sample built in full
            whole = self.scope.refetch(keys, source).to(tensor.device, tensor.dtype)
        self.counts.refetched += len(stand)

        def swap(value: Any) -> Any:
            return whole if value is tensor or same_tensor(value, tensor) else value

        return tuple(swap(v) for v in args), {k: swap(v) for k, v in kwargs.items()}

    def _trainable(self, stamp: Stamp) -> str | None:
        trainable = self._weights.trainable(stamp)
        if not trainable:
            return None
        # Trained while unfrozen, the weights may change where this rank's stamp does not
        # see it (under FSDP, on another rank's shard): fingerprint them again once frozen.
        self._stamp = None
        shown = ", ".join(trainable[:3]) + (", ..." if len(trainable) > 3 else "")
        return (
            f"a parameter of `{self.name}` requires grad now ({shown}): a stored output would "
            f"cut its gradient"
        )

    def _weights_fingerprint(self, stamp: Stamp) -> str:
        if stamp != self._stamp:
            fresh, moved = fingerprint(self.module), self._weights.attributes_moved()
            if fresh != self._fingerprint and self._fingerprint:
                if moved:  # not the weights: a setting of its forward's, a temperature
                    self.scope.warn_once(attributes_changed(self.name, moved))
                self.scope.store.drop(where=self.name)  # features of weights gone by
                if self.scope.store.disk is not None:  # their shards stay, uncounted
                    name = self.name
                    self.scope.store.disk.release(lambda b: b[0] == name and b[1] != fresh)
                self.forget()
                self.drops += 1
            self._stamp, self._fingerprint = stamp, fresh
        return self._fingerprint

    # -- storing, checking, serving -------------------------------------------------------

    def _leaves(
        self, out: Any, rows: int, slot: Slot, signature: Hashable
    ) -> tuple[list[torch.Tensor], Any] | None:
        """``out``'s tensors and its structure (``None`` fields, such as hidden states not
        asked for, kept as they are); None (and stand down) when not one row per sample."""
        tree_flatten, _ = _compat.tree_flatten_and_map()
        leaves, spec = tree_flatten(out)
        tensors = [t for t in leaves if t is not None]
        if not tensors or not all(
            isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == rows for t in tensors
        ):
            self.stand_down("its output is not made of tensors with one row per sample")
            return None
        places = [i for i, t in enumerate(leaves) if t is not None]
        dtypes, devices = [t.dtype for t in tensors], [t.device for t in tensors]
        slot.layouts[signature] = (spec, places, len(leaves), dtypes, devices,
                                   [t.dim_order() for t in tensors])  # fmt: skip
        return tensors, spec

    def _keep(
        self,
        flat: tuple[list[torch.Tensor], Any],
        base: tuple[Hashable, ...],
        keys: Sequence[Hashable],
        rows: list[int],
        slot: Slot,
    ) -> None:
        """Count ``rows`` of the output as run, and store each under its sample's key."""
        self.counts.misses += len(flat[0][0]) if flat[0] else 0
        first: dict[Hashable, int] = {}  # a key twice in a batch (drawn with replacement): once
        for row, key in zip(rows, keys, strict=True):
            first.setdefault(key, row)
        if not first or self.scope.store.full:
            self.counts.not_stored += len(first)
            return
        # SYNC: on an accelerator, the copy to host memory waits for the module's output.
        host = [t.detach().to(dtype=self.scope.dtype or t.dtype, device="cpu") for t in flat[0]]
        for key, row in first.items():
            if self.scope.store.put((*base, key), tuple(t[row].clone() for t in host)):
                self.counts.stored += 1
                slot.ready.add(key)
            else:
                self.counts.not_stored += 1

    def _check(
        self, flat: tuple[list[torch.Tensor], Any], found: list[Any], hit: list[int], slot: Slot
    ) -> bool:
        """The first reuse: the stored rows must equal the rows just computed."""
        for j, leaf in enumerate(flat[0]):
            stored = torch.stack([found[i][j] for i in hit])
            # SYNC: the comparison reads the recomputed rows on the host (once per module).
            again = leaf.detach()[hit].to(dtype=stored.dtype, device="cpu")
            tolerance = 1e-4 if stored.dtype in (torch.float32, torch.float64) else 1e-2
            if not torch.equal(again, stored) and not torch.allclose(
                again.float(), stored.float(), rtol=tolerance, atol=tolerance
            ):
                largest = float((again.float() - stored.float()).abs().max())
                unchecked = self.scope.layouts is None or slot.source is None
                self.stand_down(mismatch(largest, ROWS_UNCHECKED if unchecked else ""), wrong=True)
                return False
        slot.verified = True
        self.counts.verified = self.verified
        return True
