"""A tuned train loader leaves the random generators where the loader as given would, epoch
after epoch, so that a seeded run sees the sample order it would have seen untuned.

A DataLoader draws from random generators in two places. Each time it makes an iterator it
draws a base seed for its workers (from its ``generator``, torch's global one without).
While an epoch runs, its sampler draws what it needs: ``RandomSampler(generator=g)`` a
permutation of ``g``, and one more (of which it keeps nothing) when its iterator is asked
past its end; without a generator, a seed from torch's global one as the epoch starts.
Other worker settings change both. Persistent workers make one iterator for the whole fit,
so they draw one base seed where the loader as given drew one an epoch; and workers ask
the sampler ahead of training, so every epoch runs it past its end, where Lightning stops
an in-process loader at its length. Either way the next epoch's shuffle starts from
another state, and every epoch from the second on had another order than the untuned run.

Counting those draws breaks with the next sampler that draws otherwise. :class:`UntunedDraws`
instead replays the epoch as the loader as given runs it. At each epoch end it sets the
sampler's own generators back to the state they had as the epoch's shuffle started and
asks a fresh iterator of the same sampler for as many batches as the loader as given asks
(the batches trained, and with workers those they ask ahead): whatever the sampler draws,
its generators end where the given loader's would. It then gives the loader in use a
generator of its own for the base seeds of its later iterators (a copy of the user's, so its
workers' seeds still follow the run's seed), and draws in the user's generator the base
seed the loader as given draws as the next epoch starts (not for persistent workers).

Assumed: the sampler's ``__iter__`` only reads its generators (torch's samplers do), and
nothing but the loader draws from a generator a sampler holds.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_speedkit import _compat

#: Generator states as the first epoch of a loader adopted since starts its shuffle.
_FIRST: weakref.WeakKeyDictionary[torch.Generator, torch.Tensor] = weakref.WeakKeyDictionary()
#: Loaders the kit built for the fit loop (their base seeds may be drawn elsewhere).
_OURS: weakref.WeakSet[DataLoader[Any]] = weakref.WeakSet()
#: The user's generator of each loader given one of its own (None: torch's global one).
_USERS: weakref.WeakKeyDictionary[DataLoader[Any], torch.Generator | None] = (
    weakref.WeakKeyDictionary()
)


def _base_draw(generator: torch.Generator | None) -> None:
    """The draw a DataLoader makes for its workers' base seed as it makes an iterator."""
    torch.empty((), dtype=torch.int64).random_(generator=generator)


def _sampler_generators(loader: DataLoader[Any]) -> list[torch.Generator]:
    """The CPU generators ``loader``'s sampler or batch sampler hold (and draw from)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    holders = (getattr(loader, "sampler", None), batch_sampler,
               getattr(batch_sampler, "sampler", None))  # fmt: skip
    found: list[torch.Generator] = []
    for holder in holders:
        generator = getattr(holder, "generator", None)
        if (isinstance(generator, torch.Generator) and generator.device.type == "cpu"
                and all(generator is not g for g in found)):  # fmt: skip
            found.append(generator)
    return found


def _first_states(loader: DataLoader[Any]) -> dict[torch.Generator, torch.Tensor]:
    """The sampler's generators' states as ``loader``'s first epoch starts its shuffle: now,
    but for the base seed its first iterator draws first (where from the same generator)."""
    states = {}
    for generator in _sampler_generators(loader):
        state = generator.get_state()
        if generator is loader.generator:
            scratch = torch.Generator()
            scratch.set_state(state)
            _base_draw(scratch)
            state = scratch.get_state()
        states[generator] = state
    return states


def adopt(loader: DataLoader[Any], *, starts_an_epoch: bool = True) -> DataLoader[Any]:
    """Note ``loader``, built by the kit for the fit loop, as the kit's, and, where its
    first iterator starts the next epoch (not a loader for the epochs after the one under
    way), its sampler's generators' states as that epoch starts its shuffle."""
    _OURS.add(loader)
    if starts_an_epoch:
        _FIRST.update(_first_states(loader))
    return loader


def _settings(loader: DataLoader[Any]) -> tuple[int, bool, int | None]:
    """What decides a loader's draws: workers, persistent or not, and their prefetch."""
    workers = loader.num_workers
    persistent = bool(loader.persistent_workers and workers)
    return workers, persistent, loader.prefetch_factor if workers else None


class UntunedDraws:
    """The draws of ``given``, the train loader as the user gave it, made at each epoch end
    for the loader the fit loop trains on (see the module's docstring)."""

    def __init__(self, given: DataLoader[Any]) -> None:
        self.given = given
        workers, self.reuses, prefetch = _settings(given)  # reuses: one iterator for the fit
        self.ahead = workers * (prefetch or 0)  # batches its workers ask the sampler ahead
        self.start = _first_states(given)  # as the epoch under way started its shuffle
        for generator in self.start:
            _FIRST.pop(generator, None)  # a fit before this one's
        self.switched = False  # the epoch under way changed loaders

    def epoch_ended(self, loader: Any, batches: float, reloads: bool = False) -> None:
        """Leave the generators where ``given`` would as the next epoch starts, after an
        epoch of ``batches`` trained on ``loader``; ``reloads``: the fit loop builds the next
        epoch's loader anew (which draws its own base seed).

        Example::

            >>> g = torch.Generator().manual_seed(5)
            >>> given = DataLoader(range(8), batch_size=4, shuffle=True, generator=g)
            >>> draws = UntunedDraws(given)
            >>> tuned = DataLoader(range(8), batch_size=4, sampler=given.sampler, generator=g,
            ...                    num_workers=1, persistent_workers=True)
            >>> _ = list(given.sampler)  # its epoch, run past its end as workers do
            >>> draws.epoch_ended(adopt(tuned, starts_an_epoch=False), batches=2)
            >>> after = g.get_state()
            >>> _ = g.manual_seed(5)
            >>> untuned = iter(given)
            >>> _ = next(untuned), next(untuned)  # the epoch's two batches, as Lightning takes
            >>> _ = torch.empty((), dtype=torch.int64).random_(generator=g)  # next iterator
            >>> torch.equal(after, g.get_state())
            True
        """
        if not isinstance(loader, DataLoader):
            return
        if _settings(loader) == _settings(self.given) and not self.switched:
            return  # it draws as the loader as given does
        self.switched = False
        # torchdata's StatefulDataLoader swaps in a sampler that keeps its generator's state
        # in the loader's state_dict and restores it itself: no replay there
        if not callable(getattr(loader, "state_dict", None)):
            self._replay(loader, batches)
        user = _USERS.get(loader, loader.generator)
        if reloads:
            self.start = {}  # the next loader notes its own (adopt)
            return
        if loader in _OURS and loader not in _USERS:
            _USERS[loader] = loader.generator
            own = torch.Generator()
            own.set_state((user if user is not None else torch.default_generator).get_state())
            loader.generator = own  # its later iterators' base seeds are drawn from it
        draws_own = loader not in _USERS and not _compat.reuses_its_workers(loader)
        if not self.reuses and not draws_own:
            _base_draw(user)  # the untuned loader's, as its next iterator starts
        self.start = _first_states(loader) if draws_own else {
            generator: generator.get_state() for generator in _sampler_generators(loader)
        }  # fmt: skip

    def _replay(self, loader: DataLoader[Any], batches: float) -> None:
        """Draw the epoch's shuffle again from its start, as ``given`` asks for it."""
        generators = _sampler_generators(loader)
        starts = {g: _FIRST.get(g, self.start.get(g)) for g in generators}
        known = {g: state for g, state in starts.items() if state is not None}
        if not generators or len(known) < len(generators) or batches == float("inf"):
            return  # nothing drawn, or from a state not known
        for generator, state in known.items():
            _FIRST.pop(generator, None)
            generator.set_state(state)
        order = iter(loader.batch_sampler if loader.batch_sampler is not None else loader.sampler)
        end = object()
        for _ in range(int(batches) + self.ahead):
            if next(order, end) is end:
                break
