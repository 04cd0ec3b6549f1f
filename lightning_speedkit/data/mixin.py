"""SpeedDataModuleMixin: tuned loader settings, length bucketing and packing for a DataModule."""

from __future__ import annotations

import inspect
import multiprocessing
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit import _validation
from lightning_speedkit.data._epoch_draws import adopt
from lightning_speedkit.data.bucketing import LengthBucketBatchSampler
from lightning_speedkit.data.cache import SampleCache
from lightning_speedkit.data.worker_search import cpu_budget
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["SpeedDataModuleMixin", "built_by_speed_dataloader"]

#: The loaders ``speed_dataloader`` made (a hook of the mixin may build its own instead).
_BUILT: weakref.WeakSet[DataLoader[Any]] = weakref.WeakSet()


def built_by_speed_dataloader(loader: Any) -> bool:
    """Whether ``speed_dataloader`` made ``loader``, and so builds the next one with the
    tuned settings it is given."""
    return loader in _BUILT


class _Served(Iterator[Any]):
    """A loader's iterator of the epoch under way, counting the batches it has served."""

    def __init__(self, batches: Iterator[Any], served: int = 0) -> None:
        self.batches, self.served = batches, served

    def __iter__(self) -> _Served:
        return self

    def __next__(self) -> Any:
        batch = next(self.batches)
        self.served += 1
        return batch


class _ResumableBucketLoader(DataLoader):  # type: ignore[type-arg]
    """``speed_dataloader``'s loader over a :class:`LengthBucketBatchSampler`: a fit resumed
    from a checkpoint taken in the middle of an epoch goes on with the batches the epoch
    had left, in its order, whatever the workers.

    Lightning saves a train loader's ``state_dict`` in every checkpoint and, resuming,
    loads it before it iterates and runs only the epoch's remaining batch count. The
    state is the epoch and the batches served in it (each iterator counts them); since
    the bucketed batches depend only on the sampler's seed and the epoch, loading it has
    the batch sampler skip those served (:meth:`LengthBucketBatchSampler.resume`).
    """

    _served: _Served | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._served = _Served(super().__iter__())
        return self._served

    def state_dict(self) -> dict[str, int]:
        """The epoch and the batches of it this loader has served (all: the epoch ended)."""
        sampler = self.batch_sampler
        served = self._served.served if self._served is not None else 0
        return {"epoch": int(getattr(sampler, "epoch", 0)), "batches": served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Go on where ``state`` was taken: after its served batches, or with the next
        epoch where it had served them all."""
        sampler = self.batch_sampler
        if not isinstance(sampler, LengthBucketBatchSampler) or not state:
            return
        epoch, served = int(state["epoch"]), int(state["batches"])
        if served >= len(sampler):
            epoch, served = epoch + 1, 0
        sampler.resume(epoch, served)

    def go_on_with(self, running: Iterator[Any], rest: Iterator[Any]) -> Iterator[Any]:
        """The rest of the epoch that ``running`` (this class's iterator, in another loader
        like this one) was in, served by ``rest``, counted on as this loader's."""
        served = running.served if isinstance(running, _Served) else 0
        self._served = _Served(rest, served)
        return self._served


def _served_by(iterator: Any) -> Any:
    """The torch iterator a :class:`_ResumableBucketLoader`'s iterator counts (``iterator``
    itself for another loader's)."""
    return iterator.batches if isinstance(iterator, _Served) else iterator


def _bucket_sampler(
    dataset: Any, lengths: Sequence[int], batch_size: int, num_replicas: int | None,
    rank: int | None, **kwargs: Any,
) -> LengthBucketBatchSampler:  # fmt: skip
    """``speed_dataloader``'s bucketing batch sampler, ``lengths`` one per sample."""
    if len(lengths) != len(dataset):
        raise SpeedkitConfigError(
            f"`lengths` has {len(lengths)} entries but the dataset has "
            f"{len(dataset)} samples; give one length per sample."
        )
    return LengthBucketBatchSampler(lengths, batch_size, num_replicas=num_replicas, rank=rank,
                                    **kwargs)  # fmt: skip


def _default_start_method() -> str:
    """The start method multiprocessing would pick now (without fixing it for the process)."""
    return multiprocessing.get_context().get_start_method()


class SpeedDataModuleMixin:
    """Mix into a LightningDataModule; build its loaders with :meth:`speed_dataloader`.

    - :class:`~lightning_speedkit.data.NumWorkersTuner` writes its choice to
      ``speed_loader_kwargs``, and every loader built afterwards uses it, so
      reloading loaders (``reload_dataloaders_every_n_epochs``) keeps the tuning.
      The hook runs once more per fit with the tuner (once to be measured, once to
      build with the tuned settings): keep costly work in ``setup()``.
    - ``lengths=`` turns on length bucketing with a distributed-aware
      :class:`~lightning_speedkit.data.LengthBucketBatchSampler` (every sample
      once per epoch across ranks), in a loader that a fit resumed from a mid-epoch
      checkpoint continues where it stopped.
    - Pass a :class:`~lightning_speedkit.data.PackingCollate` as ``collate_fn`` to
      pack sequences instead of padding them.
    - ``cache=True`` (or a byte budget) keeps decoded samples in memory after their
      first read (:class:`~lightning_speedkit.data.SampleCache`); the same cache
      serves every loader built from that dataset, so it survives reloads.
      ``warm_cache=True`` fills it before the first batch, in parallel worker processes
      (:meth:`~lightning_speedkit.data.SampleCache.warm`), so that the first epoch
      runs at the cache's speed too.

    Example::

        >>> import lightning as L
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> class Data(SpeedDataModuleMixin, L.LightningDataModule):
        ...     def train_dataloader(self):
        ...         ds = TensorDataset(torch.arange(10))
        ...         return self.speed_dataloader(ds, batch_size=4, lengths=list(range(10)))
        >>> [len(b[0]) for b in Data().train_dataloader()]
        [4, 4, 2]
    """

    speed_loader_kwargs: dict[str, Any]

    def speed_dataloader(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int,
        shuffle: bool = False,
        drop_last: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        lengths: Sequence[int] | None = None,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        cache: bool | int = False,
        warm_cache: bool = False,
        **kwargs: Any,
    ) -> DataLoader[Any]:
        """A DataLoader with the tuned worker settings (taking precedence over ``kwargs``).

        Args:
            dataset: the dataset.
            batch_size: samples per batch (the most per batch with bucketing).
            shuffle: shuffle samples (and, with bucketing, batches) each epoch.
            drop_last: drop the last incomplete batch(es).
            collate_fn: e.g. a padding collate, or a ``PackingCollate``.
            lengths: per-sample lengths; turns on length bucketing.
            seed: bucketing's base seed (the same on every rank).
            num_replicas, rank: with ``lengths``, the ranks bucketed batches are split
                among and this one's, for a loader built outside Lightning's hooks (inside
                them they come from the ``DistributedSampler`` Lightning injects).
            cache: keep samples in memory after their first read: True, or the most
                bytes of samples per process (see :class:`SampleCache` for
                what the dataset must promise).
            warm_cache: with ``cache``, read every sample into it now, in one worker
                process per core this rank may use (the machine's cores shared among
                its ranks; in-process with one core), with the loader's
                ``worker_init_fn`` and ``multiprocessing_context``. Each DDP rank warms
                its own copy: mind the memory. Skipped, with a warning, when the loader's
                workers are spawned rather than forked (they would start empty).
            **kwargs: other DataLoader arguments (``num_workers`` etc.), used until
                the tuner has chosen.
        """
        _validation.positive_int("batch_size", batch_size, example=32)
        if lengths is None and (num_replicas is not None or rank is not None):
            raise SpeedkitConfigError(
                "`num_replicas` and `rank` split bucketed batches among ranks, and no "
                "`lengths` were given; pass `lengths=` to bucket, or give a plain loader a "
                "`sampler=DistributedSampler(dataset, num_replicas, rank)` (in a fit, "
                "Lightning injects one)."
            )
        _validation.boolean("shuffle", shuffle)
        _validation.boolean("drop_last", drop_last)
        _validation.optional(_validation.function, "collate_fn", collate_fn,
                             fix="pass a function of a list of samples, or None")  # fmt: skip
        _validation.integer("seed", seed)
        if not isinstance(cache, bool):
            _validation.positive_int("cache", cache, example=2**30,
                                     hint="True, False, or the most bytes to keep")  # fmt: skip
        _validation.boolean("warm_cache", warm_cache)
        if warm_cache and cache is False:
            raise SpeedkitConfigError(
                "`warm_cache=True` fills the sample cache, but `cache` is False; pass "
                "`cache=True` (or a byte budget) with it."
            )
        tuned = dict(getattr(self, "speed_loader_kwargs", None) or {})
        options = {**kwargs, **tuned}
        if cache is not False:
            # The caller (the hook that builds this loader) keeps its latest cache alive.
            caller = inspect.currentframe()
            code = caller.f_back.f_code if caller and caller.f_back else None
            site = (code.co_filename, code.co_firstlineno, code.co_name) if code else None
            del caller
            cached = self._sample_cache(dataset, None if cache is True else cache, site)
            if warm_cache and self._warming_reaches_the_loader(options):
                cores = cpu_budget(self._local_ranks())
                cached.warm(
                    num_workers=cores if cores > 1 else 0,  # one worker is slower than none
                    progress=self._is_global_zero(),
                    worker_init_fn=options.get("worker_init_fn"),
                    multiprocessing_context=options.get("multiprocessing_context"),
                )
            dataset = cached
        if options.get("num_workers", 0) == 0:
            options.pop("prefetch_factor", None)
            options["persistent_workers"] = False
        if lengths is not None:
            sampler = _bucket_sampler(dataset, lengths, batch_size, num_replicas, rank,
                                      shuffle=shuffle, seed=seed, drop_last=drop_last)  # fmt: skip
            loader: DataLoader[Any] = _ResumableBucketLoader(
                dataset, batch_sampler=sampler, collate_fn=collate_fn, **options
            )
        else:
            loader = DataLoader(
                dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                collate_fn=collate_fn, **options,
            )  # fmt: skip
        _BUILT.add(loader)
        if tuned:  # built for the fit loop with the tuner's settings
            adopt(loader)
        return loader

    def _warming_reaches_the_loader(self, options: dict[str, Any]) -> bool:
        """Whether the loader's reads see a warmed cache: in this process, or in workers
        forked from it. Spawned workers start with an empty cache (``__getstate__``), so
        warming for them costs time and memory for nothing: said once, and skipped."""
        if options.get("num_workers", 0) == 0:
            return True
        context = options.get("multiprocessing_context")
        method = (
            context
            if isinstance(context, str)
            else context.get_start_method()
            if context is not None
            else multiprocessing.get_start_method(allow_none=True) or _default_start_method()
        )
        if method == "fork":
            return True
        if not self.__dict__.get("_speed_warm_skipped"):
            self.__dict__["_speed_warm_skipped"] = True
            rank_zero_warn(
                f"warm_cache: the loader's {options['num_workers']} worker(s) start by "
                f"{method!r}, which gives each an empty cache: the cache is not warmed. "
                f"Warm it for an in-process loader (num_workers=0), or start the workers "
                f"by fork (multiprocessing_context='fork', where the platform has it)."
            )
        return False

    def _local_ranks(self) -> int:
        """Training processes on this machine (1 before a Trainer is attached)."""
        trainer = getattr(self, "trainer", None)
        return max(1, int(getattr(trainer, "num_devices", 1) or 1)) if trainer else 1

    def _is_global_zero(self) -> bool:
        trainer = getattr(self, "trainer", None)
        return bool(getattr(trainer, "is_global_zero", True)) if trainer else True

    def _sample_cache(
        self, dataset: Dataset[Any], max_bytes: int | None, site: object = None
    ) -> SampleCache:
        """The one cache of ``dataset``, made on first use (so reloaded loaders reuse it).

        Each call site (the hook that builds the loader) holds its latest cache, and any
        loader built over a cache holds that one; nothing else does. So a hook that makes
        the same dataset's loader again (a reload) finds its cache, and one that makes a
        new dataset at each reload (a curriculum) lets the last one's cache go with its
        loader: memory holds one cache per hook, not one per reload.
        """
        if isinstance(dataset, SampleCache):
            return dataset
        caches: _Caches = self.__dict__.setdefault("_speed_sample_caches", _Caches())
        cached = caches.by_dataset.get(id(dataset))
        if cached is None or cached.dataset is not dataset or cached.max_bytes != max_bytes:
            cached = caches.by_dataset[id(dataset)] = SampleCache(dataset, max_bytes=max_bytes)
        caches.latest[site] = cached
        return cached


class _Caches:
    """A DataModule's sample caches: by dataset (weakly), and the latest per call site.

    A copy sent to another process (``ddp_spawn`` pickles the DataModule) starts empty,
    as a :class:`SampleCache` sent to a worker does.
    """

    def __init__(self) -> None:
        self.by_dataset: weakref.WeakValueDictionary[int, SampleCache] = (
            weakref.WeakValueDictionary()
        )
        self.latest: dict[object, SampleCache] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
