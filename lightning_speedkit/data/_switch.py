"""Switch a DataLoader's worker settings in the middle of an epoch, losing and repeating nothing.

A DataLoader iterator draws the epoch's batches of indices from its sampler as it goes
(one at a time in the training process, a few ahead with workers). The rest of the
epoch's order is therefore what that sampler iterator has not handed out yet, plus what
it has handed to workers that have not come back. :func:`switch_loader` takes the
sampler iterator from the running iterator, lets the old iterator deliver only what its
workers already hold, and has a loader with the new settings load the rest: every
sample not yet seen this epoch, exactly once, in the order the epoch would have had,
whatever the sampler (shuffled, seeded or not, distributed, a batch sampler of the
user's). Later epochs use the loader rebuilt with the new settings.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, Sampler

from lightning_speedkit import _compat
from lightning_speedkit._random import loader_generators, random_state_kept
from lightning_speedkit.data._fork import garbage_kept_from_children
from lightning_speedkit.data.mixin import _ResumableBucketLoader, _served_by
from lightning_speedkit.data.rebuild import _TAKES_IN_ORDER, rebuild_dataloader


def why_not_switched(loader: Any, iterator: Any) -> str | None:
    """Why the epoch under way on ``loader`` (``iterator``, its running iterator) cannot
    go on with other settings; None if it can."""
    if not isinstance(loader, DataLoader):
        return f"the train loader is a {type(loader).__name__}, not a torch DataLoader"
    counts = isinstance(loader, _ResumableBucketLoader)  # its place holds for any workers
    if counts:
        iterator = _served_by(iterator)
    if not _compat.is_dataloader_iterator(iterator):
        return f"its iterator, a {type(iterator).__name__}, is not a torch DataLoader's"
    if isinstance(loader.dataset, IterableDataset):
        return (
            "its dataset is an IterableDataset, whose place in the epoch lives inside its own "
            "iteration (in each worker), where a loader with other workers cannot pick it up"
        )
    if callable(getattr(loader, "state_dict", None)) and not counts:
        return (
            f"the train loader, a {type(loader).__name__}, saves its place in the epoch for "
            f"mid-epoch resume, and that state holds only for the worker count it was taken "
            f"with (torchdata's StatefulDataLoader refuses it under another): a checkpoint "
            f"taken during the rest of this epoch could not resume it"
        )
    return None


class _Rest(Sampler[Any]):
    """What a running DataLoader iterator's sampler has not handed out yet (once)."""

    def __init__(self, rest: Iterator[Any]) -> None:
        self.rest = rest

    def __iter__(self) -> Iterator[Any]:
        return self.rest


class _EpochRest(Iterator[Any]):
    """The batches the old iterator's workers already hold, then those of the new loader."""

    def __init__(self, old: Iterator[Any], new: Iterator[Any]) -> None:
        self.old: Iterator[Any] | None = old
        self.new = new

    def __next__(self) -> Any:
        if self.old is not None:
            try:
                return next(self.old)
            except StopIteration:
                _, shutdown = _compat.loader_iterator_workers(self.old)
                if shutdown is not None:  # persistent workers wait for an epoch that never comes
                    shutdown()
                self.old = None
        return next(self.new)


def switch_loader(
    loader: DataLoader[Any], iterator: Iterator[Any], settings: dict[str, Any]
) -> tuple[DataLoader[Any], Iterator[Any]]:
    """``loader`` rebuilt with ``settings`` (worker settings, as
    :func:`~lightning_speedkit.data.rebuild.rebuild_dataloader` takes), and the rest
    of the epoch that ``iterator``, a running iterator of ``loader``, is in, loaded with them.

    Iterate the second instead of ``iterator`` (which gives nothing new after this) for the
    rest of the epoch, and the first from the next epoch on. Refuse beforehand what
    :func:`why_not_switched` names.

    Example::

        >>> import torch
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(list(range(10)), batch_size=2, shuffle=True)
        >>> running = iter(loader)
        >>> seen = [next(running), next(running)]
        >>> settings = {"num_workers": 0, "prefetch_factor": None}
        >>> new, rest = switch_loader(loader, running, settings)
        >>> sorted(int(i) for batch in seen + list(rest) for i in batch)
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    """
    why = why_not_switched(loader, iterator)
    if why is not None:
        raise ValueError(f"The epoch cannot switch loaders: {why}.")
    counted, iterator = iterator, _served_by(iterator)  # (speed_dataloader's bucketed loader)
    taken = _compat.take_sampler_iterator(iterator)
    again = rebuild_dataloader(loader, **settings)
    # The rest of this epoch: the same dataset, collate_fn and settings, drawing from the
    # taken sampler iterator. Its workers end with the epoch (nothing to persist for).
    batching: dict[str, Any] = (
        {"batch_sampler": _Rest(taken)}
        if loader.batch_sampler is not None
        else {"sampler": _Rest(taken), "batch_size": None}
    )
    workers = again.num_workers > 0
    options: dict[str, Any] = {
        **batching,
        "num_workers": again.num_workers,
        "collate_fn": again.collate_fn,
        "pin_memory": again.pin_memory,
        "timeout": again.timeout if workers else 0,
        "worker_init_fn": again.worker_init_fn,
        "multiprocessing_context": again.multiprocessing_context if workers else None,
        "generator": again.generator,
        "prefetch_factor": again.prefetch_factor if workers else None,
        "persistent_workers": False,
        "pin_memory_device": again.pin_memory_device,
    }
    if _TAKES_IN_ORDER:
        options["in_order"] = getattr(again, "in_order", True)
    rest: DataLoader[Any] = DataLoader(again.dataset, **options)
    # Its workers start here, while the old ones finish; starting draws their base seed from
    # the loader's generator (torch's global one without): a draw the untuned run never
    # made mid-epoch, which would change every later number of a seeded run.
    with garbage_kept_from_children(), random_state_kept(loader_generators(rest)):
        started = iter(rest)
    if isinstance(again, _ResumableBucketLoader):  # its count of the epoch's batches goes on
        return again, again.go_on_with(counted, _EpochRest(iterator, started))
    return again, _EpochRest(iterator, started)
