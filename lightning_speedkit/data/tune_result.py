"""TuneResult: what the worker search found, as :func:`~lightning_speedkit.data.tune_num_workers`
returns it and its cache keeps it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, TypeGuard

from torch.utils.data import DataLoader

__all__ = ["TuneResult", "measured"]


@dataclass
class TuneResult:
    """What tuning found.

    Attributes:
        best: DataLoader keyword arguments to use (``num_workers``, ``pin_memory``,
            ``persistent_workers``, ``prefetch_factor``).
        table: every candidate tried, with ``batches_per_sec`` (None if skipped)
            and ``skipped`` (the reason, or None).
        best_batches_per_sec: the measured rate of ``best``.
        given_batches_per_sec: the measured rate of the loader as it was given.
        seconds: time spent tuning (0 when the result came from the cache).
        cached: the result was read from the cache rather than measured.
        dataloader: the loader rebuilt with ``best`` (from :func:`tune_num_workers`).
        pending: settings measured faster than ``best`` that the train loader does not
            use yet (set by :class:`~lightning_speedkit.data.NumWorkersTuner` when it
            cannot switch in the middle of an epoch): ``best`` stays the loader in use
            until the next epoch starts with ``pending``. None otherwise.
        pending_reason: why ``pending`` waits for the next epoch.
        untuned: why nothing was measured and the loader is left as given (an
            ``IterableDataset`` whose source reading uses up); None when it was measured.

    Example::

        >>> result = TuneResult({"num_workers": 2}, table=[], best_batches_per_sec=24.0)
        >>> sorted(result.to_json())[:3]
        ['best', 'best_batches_per_sec', 'cached']
    """

    best: dict[str, Any]
    table: list[dict[str, Any]]
    best_batches_per_sec: float
    given_batches_per_sec: float | None = None
    seconds: float = 0.0
    cached: bool = False
    dataloader: DataLoader[Any] | None = field(default=None, repr=False)
    pending: dict[str, Any] | None = None
    pending_reason: str | None = None
    untuned: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("dataloader")
        return data


def measured(result: TuneResult | None) -> TypeGuard[TuneResult]:
    """Whether ``result`` holds measured rates, as the verdict needs: it is there and the
    loader was not left untuned (see ``TuneResult.untuned``)."""
    return result is not None and result.untuned is None
