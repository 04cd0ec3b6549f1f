"""Module hook dicts and DataLoader iterators: what attention/ and data/ read."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

from lightning_speedkit._compat._reading import _missing, _private

# --- attention/ and data/ -----------------------------------------------------------------------

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_always_called",
)


def hook_dicts(
    module: Any,
) -> tuple[dict[int, Any], dict[int, Any], dict[int, Any], dict[int, Any]]:
    """``module``'s forward-hook dicts: pre-hooks, which of them take kwargs, hooks, which
    of them always run. The traced family's discovery fills them with one shared handle's
    id for each probed module (a handle per module would cost a registration each)."""
    found = [getattr(module, name, None) for name in _HOOK_DICTS]
    for name, value in zip(_HOOK_DICTS, found, strict=True):
        if value is None:
            raise _missing("torch", f"nn.Module.{name}", "AttentionSwap's discovery fills")
    pre, pre_kwargs, post, always = found
    return pre, pre_kwargs, post, always  # type: ignore[return-value]


def mha_same_embed_dim(module: Any) -> bool:
    """Whether an ``nn.MultiheadAttention`` takes keys and values of the query's size."""
    same = _private(
        module, "_qkv_same_embed_dim", "torch", "nn.MultiheadAttention._qkv_same_embed_dim",
        "AttentionSwap reads to build an example input for a MultiheadAttention",
    )  # fmt: skip
    return bool(same)


def loader_iterator_workers(iterator: Any) -> tuple[list[Any], Callable[[], None] | None]:
    """A DataLoader iterator's worker processes and its orderly shutdown: the worker search
    ends a failed candidate's workers itself. An in-process iterator has neither."""
    return list(getattr(iterator, "_workers", [])), getattr(iterator, "_shutdown_workers", None)


def is_dataloader_iterator(iterator: Any) -> bool:
    """Whether ``iterator`` is a torch DataLoader's (``_BaseDataLoaderIter``)."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    return isinstance(iterator, _BaseDataLoaderIter)


def take_sampler_iterator(iterator: Any) -> Any:
    """A running DataLoader iterator's sampler iterator (``_sampler_iter``: the batches of
    indices of the epoch not handed out yet), taken from it: the iterator then delivers
    only what its workers already hold (see :func:`is_dataloader_iterator`).
    NumWorkersTuner switches a loader's workers mid-epoch with it."""
    taken = _private(
        iterator, "_sampler_iter", "torch", "torch.utils.data.dataloader._BaseDataLoaderIter"
        "._sampler_iter", "NumWorkersTuner takes the rest of an epoch's order from",
    )  # fmt: skip
    iterator._sampler_iter = iter(())
    return taken


def train_loader_running(trainer: L.Trainer) -> tuple[Any, Any] | None:
    """The fit loop's one train loader and its iterator of the epoch under way (what
    ``CombinedLoader`` iterates, ``CombinedLoader._iterator.iterators``); None when
    there is no epoch under way or the loop trains on several loaders."""
    combined = trainer.fit_loop._combined_loader
    if combined is None or len(combined.flattened) != 1:
        return None
    iterators = getattr(getattr(combined, "_iterator", None), "iterators", None)
    if not isinstance(iterators, list) or len(iterators) != 1:
        return None
    return combined.flattened[0], iterators[0]


def continue_train_epoch(trainer: L.Trainer, loader: Any, iterator: Any) -> None:
    """Make the fit loop take the rest of this epoch's batches from ``iterator`` and
    iterate ``loader`` from the next epoch on, in place of the one loader
    :func:`train_loader_running` gave. ``loader`` must have that loader's length: the
    loop counted the epoch's batches from it."""
    combined: Any = trainer.fit_loop._combined_loader
    combined._iterator.iterators[0] = iterator
    combined.flattened = [loader]  # what trainer.train_dataloader gives, and the next epoch


def tree_flatten_and_map() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """torch's pytree ``tree_flatten`` and ``tree_map`` (``torch.utils._pytree``)."""
    try:
        from torch.utils._pytree import tree_flatten, tree_map
    except ImportError as error:
        raise _missing("torch", "torch.utils._pytree", "AttentionSwap's tracer uses") from error
    return tree_flatten, tree_map


def make_wrapper_subclass(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``torch.Tensor._make_wrapper_subclass``: a tensor subclass instance with no storage
    (the tracer's placeholders)."""
    make = _private(
        torch.Tensor, "_make_wrapper_subclass", "torch", "torch.Tensor._make_wrapper_subclass",
        "AttentionSwap's tracer uses",
    )  # fmt: skip
    return make(cls, *args, **kwargs)


def disable_torch_function_subclass() -> Any:
    """A context in which tensor subclasses' ``__torch_function__`` is not called."""
    disable = _private(
        torch._C, "DisableTorchFunctionSubclass", "torch", "torch._C.DisableTorchFunctionSubclass",
        "AttentionSwap's tracer uses",
    )  # fmt: skip
    return disable()


def tensor_version(tensor: Any) -> int:
    """How many times ``tensor`` was written in place (``Tensor._version``): the
    frozen-feature cache reads it each step to know, without touching the data, whether
    a cached module's weights may have changed."""
    version = getattr(tensor, "_version", None)
    if version is None:
        raise _missing("torch", "Tensor._version", "FrozenFeatureCache reads to see weights change")
    return int(version)


def reuses_its_workers(loader: Any) -> bool:
    """Whether iterating ``loader`` again reuses the iterator, and the worker processes,
    of its last epoch (``persistent_workers``: ``DataLoader._iterator`` is kept)."""
    return bool(
        getattr(loader, "persistent_workers", False)
        and getattr(loader, "num_workers", 0) > 0
        and getattr(loader, "_iterator", None) is not None
    )


def report_worker_seed(seed: int) -> None:
    """Make ``get_worker_info().seed`` report ``seed`` in this worker process (nothing
    outside one). torch offers no setter: its module global ``_worker_info`` holds the
    worker's ``WorkerInfo``, a frozen dataclass in torch 2.13, replaced here by a copy.
    Where that ever changes, the seed reported stays the worker's own (NumWorkersTuner's
    split check then tells an unsplit stream shuffled by that seed only by its samples)."""
    from torch.utils.data._utils import worker

    info = getattr(worker, "_worker_info", None)
    if isinstance(info, worker.WorkerInfo) and dataclasses.is_dataclass(worker.WorkerInfo):
        worker._worker_info = dataclasses.replace(info, seed=seed)
