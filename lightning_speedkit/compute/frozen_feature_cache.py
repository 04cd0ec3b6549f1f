"""FrozenFeatureCache: a frozen submodule's outputs stored per sample and served in later epochs.

A thin layer over :func:`~lightning_speedkit.compute._frozen_core.cache_frozen_features`:
the callback puts the cache on the LightningModule at setup, has the train loader carry
each sample's dataset index (``key="index"``), tells the cache which samples each training
batch holds, has a disk store write its shards and read the other ranks' at each epoch's
end, and takes everything off again when the fit ends.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_speedkit import _compat, _validation
from lightning_speedkit.compute._frozen_core import (
    FrozenFeatures,
    cache_frozen_features,
    check_dtype,
)
from lightning_speedkit.compute._frozen_disk import check_directory
from lightning_speedkit.compute._frozen_lease import PruneReport, prune_frozen_features
from lightning_speedkit.compute._frozen_loader import (
    IndexedDataset,
    IndexTaker,
    sample_index,
    with_sample_index,
)
from lightning_speedkit.compute._frozen_modules import check_modules
from lightning_speedkit.compute._frozen_skip import SkipPlan, can_skip, refetch_field
from lightning_speedkit.compute._frozen_store import budget_bytes
from lightning_speedkit.compute._step_batch import as_the_step_gets_it

__all__ = ["FrozenFeatureCache", "PruneReport", "cache_frozen_features", "prune_frozen_features"]

#: The name the callback's change of the train loader goes by in the fit loop's source.
OWNER = "FrozenFeatureCache"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FrozenFeatureCache(L.Callback):
    """Serve a frozen submodule's outputs (a VLM's vision tower) from a store after the first epoch.

    The first time a sample is seen, the module runs and its output is stored (in memory,
    and with ``directory`` on disk too); later the stored output is returned and the
    module does not run for that sample. With ``dtype=None`` the losses are bit for bit
    those of the run without the cache. Under DDP or DeepSpeed's ZeRO-2 each rank caches
    what its sampler gives it; with a shared ``directory`` the ranks serve each other's.

    Args:
        modules: ``"auto"`` (the frozen submodules called with a tensor of the batch as it
            is, found on the first batch), a submodule name (``"model.vision"``), a module
            type, or a list of those. Refused with the reason: a module with a parameter
            that requires grad, or with dropout or BatchNorm in train mode; and from its
            first call, one whose forward draws random numbers (a sampled posterior).
        key: what identifies a sample across epochs. ``"index"`` (default): its index in
            the train dataset, carried by the train loader, which the callback builds again
            around the same sampler (any sampler, DistributedSampler, bucketing); neither
            the batch hooks nor the model see the index; the loader also notes how each
            field's rows came from the samples, and a module whose input's rows are not
            one per sample (a varying number of images per sample) is refused. Or the name
            of a batch field with one id per row of the cached module's input (a list, or a
            tensor: on an accelerator that tensor is read to the host, a sync): one per
            image to cache a tower fed every image of the batch.
        budget: host memory the store may use: bytes, or a share of the free memory
            (``"50%"``). Past it nothing more is kept in memory: those samples run every
            time, or with a ``directory`` are served from disk.
        directory: a folder for a disk store (created if missing). Every stored feature is
            written there too, in memory-mapped shards (at each epoch's end, and every
            64 MiB), and what passes ``budget`` is served from there. A later fit (a new
            process, a resumed run) on the same weights and dataset starts warm; the ranks
            of a DDP or ZeRO-2 job may share one folder and serve each other's features
            from the next epoch on. Refused with the fix when it is a file or not writable.
            Writing stops (training goes on) before a shard would leave the disk with less
            than ``min(1 GiB, 5%)`` free. Features of earlier weights or datasets stay there
            until removed: ``FrozenFeatureCache.prune(directory, older_than=..., max_bytes=...)``
            (works without a Trainer, never touches what a running process uses), or after
            a fit ``callback.cache.prune()``, which keeps only what that fit served from.
        dtype: storage dtype; None keeps the output's (exact). ``"bfloat16"`` halves a
            float32 store and rounds the served features: the numerics change.
        verify: recompute the first reused batch and compare; on a mismatch (a random
            augmentation of the input, or state the forward reads that the key does not
            hold, such as a private attribute) stop serving, with a warning naming the
            causes. The key holds the weights, buffers, call arguments and the modules'
            public number and string attributes (read again as each epoch starts).

    Example::

        >>> cache = FrozenFeatureCache(modules=["model.vision"], budget="25%")
        >>> cache.counts
        {}
    """

    def __init__(
        self,
        modules: Any = "auto",
        key: str = "index",
        budget: int | str = "50%",
        directory: Any = None,
        dtype: torch.dtype | str | None = None,
        verify: bool = True,
    ) -> None:
        self.directory = check_directory(directory)
        self.key = _validation.text("key", key, example="index")
        budget_bytes(budget, free=0 if isinstance(budget, str) else None)  # checked now
        if isinstance(dtype, str):
            dtype = _validation.choice("dtype", dtype, list(_DTYPES))
            dtype = _DTYPES[dtype]  # type: ignore[index]
        check_modules(modules)
        self.modules, self.budget, self.dtype = modules, budget, check_dtype(dtype)
        self.verify = _validation.boolean("verify", verify)
        self.cache: FrozenFeatures | None = None
        self._state: dict[str, Any] = {}
        self._taker = IndexTaker()

    #: Remove a ``directory``'s features nobody uses (:func:`prune_frozen_features`):
    #: ``FrozenFeatureCache.prune(directory, older_than=..., max_bytes=...)``, no Trainer.
    prune = staticmethod(prune_frozen_features)

    @property
    def counts(self) -> dict[str, Any]:
        """Samples served (``hits``) and run (``misses``), stored, the store's bytes."""
        return self.cache.counts() if self.cache is not None else {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        _compat.drop_train_loader_change(trainer, OWNER)  # a fit that raised
        if self.cache is None or self.cache.model is not pl_module:
            self.cache = cache_frozen_features(
                pl_module, self.modules, budget=self.budget, dtype=self.dtype,
                verify=self.verify, directory=self.directory,
            )  # fmt: skip
            self.cache.load_state_dict(self._state)
        else:  # a later fit of the same model: the store is still good
            self.cache.attach()
        if self.key == "index":
            _compat.change_train_loader(trainer, OWNER, partial(self._carry_index, trainer))
            self._taker.attach(trainer.precision_plugin)  # the index out before batch hooks

    def _carry_index(self, trainer: L.Trainer, loader: Any) -> Any:
        """The train loader again, carrying each sample's index; with a dataset that builds
        samples without some fields, served samples come without the cached inputs."""
        loader = carry_index(loader)
        wrapper = loader.dataset
        if not isinstance(wrapper, IndexedDataset) or self.cache is None:
            return loader
        self.cache.use_dataset(wrapper.dataset)  # an index means a sample of this dataset
        if wrapper.plan is None and can_skip(wrapper.dataset):
            wrapper.plan = SkipPlan(len(wrapper))
        if wrapper.plan is not None:
            collate = getattr(loader.collate_fn, "collate_fn", None)
            read = refetch_field(wrapper.dataset, collate, partial(as_the_step_gets_it, trainer))
            self.cache.use_loader(wrapper.plan, read)
        return loader

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.cache is not None:  # weights written through `p.data` since: seen from here
            self.cache.recheck_weights()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.cache is not None:
            index = sample_index(batch, self.key, self._taker.take())
            self.cache.start_step(index.indices, batch, index.stand_ins, index.layouts)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any
    ) -> None:
        if self.cache is not None:
            self.cache.end_step()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.cache is None or self.directory is None:
            return
        self.cache.flush()  # this rank's features of the epoch, on disk
        if trainer.world_size > 1:
            trainer.strategy.barrier("FrozenFeatureCache")  # every rank's, once per epoch
        self.cache.refresh()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self.cache is None:
            return
        self.cache.end_step()
        self.cache.remove()  # the model runs as it is outside fit; the store is kept
        _compat.drop_train_loader_change(trainer, OWNER)
        self._taker.detach()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning calls no teardown after a raise

    def state_dict(self) -> dict[str, Any]:
        """The counters per module; never the features."""
        return self.cache.state_dict() if self.cache is not None else dict(self._state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = dict(state_dict)
        if self.cache is not None:
            self.cache.load_state_dict(self._state)


def carry_index(loader: Any) -> Any:
    if not isinstance(loader, DataLoader):
        _validation.fail(
            "key",
            "index",
            f"needs a single torch DataLoader to carry the dataset "
            f"index, and the train loader is a {type(loader).__name__}",
            "pass `key='<field>'`, a batch field that identifies each sample",
        )
    return with_sample_index(loader)
