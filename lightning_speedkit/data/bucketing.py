"""LengthBucketBatchSampler: batches of similar lengths; each sample once per epoch across ranks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DistributedSampler, Sampler

from lightning_speedkit import _validation
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["LengthBucketBatchSampler"]


def _checked_lengths(lengths: Sequence[int]) -> torch.Tensor:
    """``lengths`` as int64, each refused by its index unless finite and 0 or more."""
    try:
        values = torch.as_tensor(lengths)
    except (TypeError, ValueError, RuntimeError):
        values = None
    if values is None or values.ndim != 1 or values.dtype in (torch.bool, torch.complex64,
                                                                torch.complex128):  # fmt: skip
        _validation.fail(
            "lengths", lengths, "must be one number per sample (tokens, patches, ...)",
            "pass a list or 1-D tensor of lengths, e.g. [len(s) for s in dataset]",
        )  # fmt: skip
    bad = ~torch.isfinite(values) | (values < 0) if values.is_floating_point() else values < 0
    if bool(bad.any()):
        index = int(bad.nonzero()[0])
        _validation.fail(
            f"lengths[{index}]", values[index].item(), "must be a finite length of 0 or more",
            "give every sample its length (tokens, patches, ...); drop or fix that sample",
        )  # fmt: skip
    return values.to(torch.long)


class _EpochHolder(Sampler[int]):
    """Where a :class:`LengthBucketBatchSampler` keeps its epoch when it has no
    ``DistributedSampler``: it sits at ``batch_sampler.sampler``, where Lightning calls
    ``set_epoch``. Iterating it gives the indices in order; nothing draws from it."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.num_samples))

    def __len__(self) -> int:
        return self.num_samples


class LengthBucketBatchSampler(BatchSampler):
    """Batches of samples of similar length, so that padding to the longest wastes little.

    Each epoch: shuffle all indices (seeded by ``seed + epoch``), cut them into
    pools of ``batch_size * pool_batches``, sort each pool by length and cut it into
    batches, then shuffle the batches. So batches hold similar lengths but the
    order stays random, and what a batch holds changes from epoch to epoch.

    Under DDP every rank builds the same batch list and takes every
    ``num_replicas``-th batch. Every sample is used exactly once per epoch across
    ranks and every rank gets the same number of batches (DDP needs that): when
    the batch count does not divide by the ranks, the largest batches are split
    in two until it does, so a few batches are smaller than ``batch_size``
    (``drop_last=True`` drops the remainder instead).

    Args:
        lengths: the length of each sample (tokens, patches, ...): finite, 0 or more
            (others are refused, by index).
        batch_size: most samples per batch.
        num_replicas: ranks; default the process group's size (1 without one).
        rank: this rank; default the process group's rank.
        shuffle: shuffle indices and batches (else sorted pools in index order).
        seed: base seed, the same on every rank.
        drop_last: drop samples that would make batches smaller than ``batch_size``.
        pool_batches: batches per sorting pool; larger pools pad less but make
            batch contents less random. 50 is a good start.
        sampler: set by Lightning when it injects a ``DistributedSampler`` (it does so
            for batch samplers built inside ``train_dataloader()``); only its
            ``num_replicas``, ``rank`` and ``epoch`` are used, the order stays ours.
            Any other sampler is ignored.

    The epoch lives on ``self.sampler``, not on the batch sampler: Lightning calls
    ``set_epoch`` on ``loader.sampler`` and ``loader.batch_sampler.sampler`` at each
    epoch, never on the batch sampler itself. So ``self.sampler`` is the injected
    ``DistributedSampler`` under DDP (Lightning sets its epoch on every rank), and
    otherwise a small epoch holder of ours that Lightning finds there. ``set_epoch``
    on the batch sampler sets that same epoch, so calling it by hand works too.

    Example::

        >>> s = LengthBucketBatchSampler([5, 1, 9, 3, 7, 2], batch_size=2, shuffle=False)
        >>> [sorted(b) for b in s]
        [[1, 5], [0, 3], [2, 4]]
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pool_batches: int = 50,
        sampler: Sampler[int] | None = None,
    ) -> None:
        if isinstance(sampler, DistributedSampler):
            num_replicas, rank = sampler.num_replicas, sampler.rank
        if num_replicas is None:
            num_replicas = (
                dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            )
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not isinstance(batch_size, int) or batch_size < 1:
            raise SpeedkitConfigError(
                f"`batch_size` must be a positive integer, got {batch_size!r}."
            )
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise SpeedkitConfigError(
                f"`rank` must be in [0, num_replicas); got rank={rank}, "
                f"num_replicas={num_replicas}."
            )
        if pool_batches < 1:
            raise SpeedkitConfigError(f"`pool_batches` must be at least 1, got {pool_batches}.")
        if len(lengths) < num_replicas and not drop_last:
            raise SpeedkitConfigError(
                f"{len(lengths)} samples cannot give each of {num_replicas} ranks a batch; "
                f"use fewer ranks or more data."
            )
        # BatchSampler's __init__ wants a sampler to draw from; this class orders by itself
        # and keeps only its epoch there (see the class docstring).
        self.sampler: DistributedSampler[int] | _EpochHolder = (
            sampler if isinstance(sampler, DistributedSampler) else _EpochHolder(len(lengths))
        )
        self.lengths = _checked_lengths(lengths)
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pool_batches = pool_batches
        self._built: tuple[int, list[list[int]]] | None = None  # (epoch, its batches)
        self._resume: tuple[int, int] | None = None  # (epoch, its batches already served)

    @property
    def epoch(self) -> int:
        """The epoch the batches are built for: ``self.sampler``'s, which Lightning sets."""
        return self.sampler.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Build the batches of ``epoch``. Lightning sets the epoch through ``self.sampler``
        (it never calls this); call it by hand where nothing else does."""
        self.sampler.set_epoch(epoch)

    def _all_batches(self) -> list[list[int]]:
        """This epoch's batches, built once (Lightning asks for the length several times)."""
        if self._built is None or self._built[0] != self.epoch:
            self._built = (self.epoch, self._build())
        return self._built[1]

    def _build(self) -> list[list[int]]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        n = len(self.lengths)
        order = torch.randperm(n, generator=generator) if self.shuffle else torch.arange(n)
        if self.drop_last:
            # Drop before sorting, from the end of the shuffled order: which samples go
            # changes with the epoch and does not depend on their length (sorted pools'
            # tails, dropped after sorting, would be the longest samples every epoch).
            # What is left fills whole batches, as many on every rank.
            kept = n // self.batch_size // self.num_replicas * self.num_replicas
            order = order[: kept * self.batch_size]
            n = len(order)
        pool = self.batch_size * self.pool_batches
        batches: list[list[int]] = []
        for start in range(0, n, pool):
            chunk = order[start : start + pool]
            # Stable sort: equal lengths keep their (shuffled) order.
            chunk = chunk[torch.argsort(self.lengths[chunk], stable=True)]
            batches.extend(
                chunk[i : i + self.batch_size].tolist()
                for i in range(0, len(chunk), self.batch_size)
            )
        if not self.drop_last:
            while len(batches) % self.num_replicas:
                largest = max(range(len(batches)), key=lambda i: len(batches[i]))
                if len(batches[largest]) < 2:
                    raise SpeedkitConfigError(
                        f"{len(self.lengths)} samples in batches of {self.batch_size} cannot give "
                        f"{self.num_replicas} ranks the same number of batches without repeating "
                        f"or dropping samples; pass `drop_last=True` or a larger `batch_size`."
                    )
                big = batches.pop(largest)
                half = (len(big) + 1) // 2
                batches[largest:largest] = [big[:half], big[half:]]
        if self.shuffle:
            perm = torch.randperm(len(batches), generator=generator).tolist()
            batches = [batches[i] for i in perm]
        return batches

    def resume(self, epoch: int, served: int) -> None:
        """Have the next iteration go on with ``epoch`` after its first ``served`` batches
        (of this rank): where a run stopped in the middle of an epoch left it, since the
        batches depend only on ``seed`` and the epoch. Its length stays the epoch's.

        Example::

            >>> s = LengthBucketBatchSampler([5, 1, 9, 3, 7, 2], batch_size=2, seed=1)
            >>> epoch = list(s)
            >>> s.resume(0, 1)
            >>> list(s) == epoch[1:], len(s)
            (True, 3)
        """
        self.set_epoch(epoch)  # before an iterator runs ahead (workers), whatever sets it
        self._resume = (epoch, served)

    def __iter__(self) -> Iterator[list[int]]:
        resume, self._resume = self._resume, None
        start = resume[1] if resume is not None and resume[0] == self.epoch else 0
        yield from self._all_batches()[self.rank :: self.num_replicas][start:]

    def __len__(self) -> int:
        return len(self._all_batches()) // self.num_replicas
