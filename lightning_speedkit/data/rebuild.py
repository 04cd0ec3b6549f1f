"""rebuild_dataloader: a DataLoader like the user's with other worker settings.

Everything else of the user's loader is kept: dataset, sampler or batch sampler (so
shuffling, generator, batch size and drop_last), collate_fn, worker_init_fn,
multiprocessing context; a DataLoader subclass is built again as its own class where
its arguments can be recovered.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset

from lightning_speedkit import _compat
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["TUNED_KEYS", "rebuild_dataloader"]

#: Settings the tuner owns; everything else of a loader is kept as it is.
TUNED_KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")


def _settings(loader: DataLoader[Any]) -> dict[str, Any]:
    return {
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "persistent_workers": loader.persistent_workers,
        "prefetch_factor": loader.prefetch_factor if loader.num_workers > 0 else None,
    }


def rebuild_dataloader(
    loader: DataLoader[Any],
    *,
    timeout: float | None = None,
    batch_size: int | None = None,
    **settings: Any,
) -> DataLoader[Any]:
    """A new DataLoader like ``loader`` with the given worker settings changed.

    The sampler (or custom batch sampler) object itself is reused, so the order,
    shuffling, generator, batch size and drop_last are exactly the user's.
    ``timeout`` (seconds a worker may take per batch) is the loader's unless given.
    ``batch_size``, when given, replaces the loader's; a loader batched by a custom
    batch sampler, or not batched by the loader at all, cannot take one.

    A DataLoader subclass (torchdata's ``StatefulDataLoader``, a user's) is built again
    as its own class from the arguments it was made with, as Lightning builds it around
    a distributed sampler, so what it adds (a ``state_dict`` for mid-epoch resume) is
    kept. When those cannot be recovered it is rebuilt as a torch DataLoader, with a
    warning that says what is lost.
    """
    unknown = set(settings) - set(TUNED_KEYS)
    if unknown:
        raise SpeedkitConfigError(
            f"Cannot rebuild a DataLoader with {sorted(unknown)}; only {TUNED_KEYS}."
        )
    # A batch size of its own means the loader made its batch sampler (torch's, or its
    # subclass's own class, as torchdata's StatefulDataLoader does) from it.
    if batch_size is not None and loader.batch_size is None:
        batcher = type(loader.batch_sampler).__name__ if loader.batch_sampler else "the dataset"
        raise SpeedkitConfigError(
            f"`batch_size` cannot be changed to {batch_size} on this DataLoader: its batches "
            f"come from {batcher}, not from a batch size. Set the size there yourself."
        )
    size = loader.batch_size if batch_size is None else batch_size
    kwargs: dict[str, Any] = {
        "dataset": loader.dataset,
        "collate_fn": loader.collate_fn,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "timeout": loader.timeout if timeout is None else timeout,
        "pin_memory_device": loader.pin_memory_device,
        **_settings(loader),
        **settings,
    }
    kwargs.update(_batching(loader, size))
    if _TAKES_IN_ORDER:
        kwargs["in_order"] = getattr(loader, "in_order", True)
    if kwargs["num_workers"] == 0:  # options DataLoader refuses without workers
        kwargs.update(persistent_workers=False, prefetch_factor=None, multiprocessing_context=None,
                      timeout=0)  # fmt: skip
    if kwargs["pin_memory"] and not torch.cuda.is_available():
        kwargs["pin_memory"] = False
    if type(loader) is not DataLoader:
        # A subclass (torchdata's StatefulDataLoader, a user's) is built again from its
        # own arguments, as Lightning builds it around a distributed sampler: what it adds
        # (a state_dict for mid-epoch resume) is kept.
        changes = {key: kwargs[key] for key in (*TUNED_KEYS, "timeout", "multiprocessing_context")
                   if kwargs[key] != getattr(loader, key)}  # fmt: skip
        changes.update(_batching(loader, size))
        again = _compat.dataloader_built_again(loader, changes)
        if again is not None:
            return cast("DataLoader[Any]", again)
        # Its arguments cannot be recovered, or it takes other ones: say what is lost.
        name = type(loader).__name__
        resumable = callable(getattr(loader, "state_dict", None))
        rank_zero_warn(
            f"The train loader, a {name}, cannot be built again from its own arguments (found "
            f"when it is made in a `*_dataloader` hook, else read from its attributes), so it "
            f"is rebuilt as a torch DataLoader with the same dataset, sampler, collate_fn and "
            f"settings; what {name} adds to DataLoader is not kept"
            + (
                ", its `state_dict` included: a run resumed from a mid-epoch checkpoint "
                "starts the epoch's order again (samples seen twice, others not at all). "
                "Make it in the hook, checkpoint at epoch ends, or give the loader the tuned "
                "settings yourself"
                if resumable
                else ". Make it in the hook, build a plain DataLoader, or remove the tuner"
            )
            + "."
        )
    return DataLoader(**kwargs)


_TAKES_IN_ORDER = "in_order" in inspect.signature(DataLoader).parameters  # torch >= 2.6


def _batching(loader: DataLoader[Any], size: int | None) -> dict[str, Any]:
    """The arguments that batch as ``loader`` does, at ``size``: the same sampler or
    batch sampler object, every one spelled out (a subclass's own defaults may differ)."""
    if isinstance(loader.dataset, IterableDataset):
        return {"batch_size": size, "drop_last": loader.drop_last}
    batching: dict[str, Any] = {"sampler": loader.sampler, "batch_sampler": None, "shuffle": False,
                "batch_size": None, "drop_last": False}  # fmt: skip
    if loader.batch_size is not None:
        # Spelled out rather than passed as a batch_sampler, so that Lightning, which reads
        # batch_size and sampler back to inject a DistributedSampler, sees them.
        batching.update(batch_size=size, drop_last=loader.drop_last)
    elif loader.batch_sampler is not None:  # the user's batch sampler object
        batching.update(sampler=None, batch_sampler=loader.batch_sampler, batch_size=1)
    return batching  # else automatic batching off
