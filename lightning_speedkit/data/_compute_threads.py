"""torch's threads for the model during a fit, so that the rest of a rank's cores can go
to loader workers, and torch's own count put back when the fit ends."""

from __future__ import annotations

import torch


class ComputeThreads:
    """Sets torch's intra-op threads for a fit and puts the count it found back after.

    Example::

        >>> import torch
        >>> threads, before = ComputeThreads(), torch.get_num_threads()
        >>> said = threads.give(1, cores=2)
        >>> torch.get_num_threads()
        1
        >>> threads.restore()
        >>> torch.get_num_threads() == before
        True
    """

    def __init__(self) -> None:
        self.before: int | None = None  # torch's count before give(), until restore()

    def give(self, threads: int, cores: int) -> str | None:
        """Compute with ``threads`` (at most ``cores``); what changed, or None if nothing did."""
        if threads == torch.get_num_threads():
            return None
        if self.before is None:
            self.before = torch.get_num_threads()
        torch.set_num_threads(min(threads, cores))
        return (
            f"NumWorkersTuner: torch now computes with {torch.get_num_threads()} of this "
            f"rank's {cores} core{'s' if cores != 1 else ''} (was {self.before}), leaving the "
            f"rest to loader workers."
        )

    def restore(self) -> None:
        """Put torch's count from before :meth:`give` back (nothing if it was not changed)."""
        if self.before is not None:
            torch.set_num_threads(self.before)
            self.before = None
