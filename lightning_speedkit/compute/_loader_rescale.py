"""The train loader at the tuned micro-batch, and the Trainer's batch counts kept in samples.

``limit_train_batches=16`` of micro-batches of 4 become 8 of 8 (the same 64 samples and,
where the sizes divide, the same optimizer steps), and so does an integer
``val_check_interval``; fractions are shares and stay. Loaders the fit loop requests
again later (``reload_dataloaders_every_n_epochs``) are resized too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader

from lightning_speedkit.data.worker_search import rebuild_dataloader
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["BATCH_COUNTS", "batches_in", "rescaled_counts", "resized"]

#: Trainer settings counted in train loader batches (integers; fractions are shares).
BATCH_COUNTS = ("limit_train_batches", "val_check_interval")


def resized(loader: Any, best: int) -> Any:
    """A train loader the fit loop requested again (a reload), at the tuned micro-batch."""
    if not isinstance(loader, DataLoader):
        raise SpeedkitConfigError(
            f"MicroBatchTuner trains at micro-batch {best}, and the train loader reloaded for "
            f"this epoch is a {type(loader).__name__}, not a torch DataLoader, so its batch size "
            f"cannot be set and the global batch would change. Return a DataLoader from "
            f"`train_dataloader()`, or remove MicroBatchTuner."
        )
    return loader if loader.batch_size == best else rebuild_dataloader(loader, batch_size=best)


def batches_in(loader: DataLoader[Any]) -> int | None:
    """Batches in an epoch of ``loader``; None for an IterableDataset without a length."""
    try:
        return len(loader)
    except TypeError:
        return None


def rescaled_counts(
    counts: Mapping[str, Any], given: int, best: int, batches: int | None, *, overfit: bool
) -> dict[str, tuple[Any, str | None]]:
    """Each count at micro-batch ``best`` (counted at ``given``), with the line that says so.

    An integer count is rounded up (some batches stay some, none stays none); an integer
    ``val_check_interval`` is at most the new epoch's ``batches`` (an interval of a whole
    epoch whose last batch was short stays one epoch). Fractions, booleans, an unchanged
    micro-batch and ``limit_train_batches`` under ``overfit`` (the batches to overfit, as
    given) keep their value and say nothing (None).

    Example::

        >>> rescaled_counts({"limit_train_batches": 16, "val_check_interval": 0.5}, 4, 8,
        ...                 100, overfit=False)["limit_train_batches"][0]
        8
    """
    epoch = batches
    out: dict[str, tuple[Any, str | None]] = {}
    for name, value in counts.items():
        out[name] = (value, None)
        if not isinstance(value, int) or isinstance(value, bool) or best == given:
            continue
        if name == "limit_train_batches" and overfit:
            continue  # the batches to overfit: the user's count, as given
        rounded = -(-value * given // best)  # rounded up: some stay some, none stays none
        scaled = rounded
        if name == "val_check_interval" and epoch is not None:
            scaled = min(scaled, epoch)
        if name == "limit_train_batches" and epoch is not None:
            epoch = min(epoch, scaled)
        out[name] = (scaled, _said(name, value, given, scaled, best, rounded))
    return out


def _said(name: str, value: int, given: int, scaled: int, best: int, rounded: int) -> str:
    """The line that says what ``name=value`` counted at ``given`` is at ``best``: the same
    samples, or (rounded up, or cut to the new epoch) how many it trains now."""
    batches = "micro-batch" if scaled == 1 else "micro-batches"
    head = (
        f"MicroBatchTuner: `{name}={value}` counted batches of {given} ({value * given} "
        f"samples); it is {scaled} {batches} of {best} now"
    )
    if scaled * best == value * given:
        return f"{head}, the same samples."
    if scaled < rounded:
        return f"{head}, the whole epoch at that size ({scaled * best} samples)."
    return (
        f"{head} (not {value * given / best:g}: the batches do not divide evenly), "
        f"{scaled * best} samples."
    )
