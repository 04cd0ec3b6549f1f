"""The worker search's candidates and its pick among them: pure functions of worker counts
and measured rates (batches/s), no loader and no clock.

The grid is 0, 1, 2, 4, ... up to the budget, and the budget itself. Measured alone, one
worker is no faster than loading in the training process; its gain is that it loads
while the model trains. So workers beat ``num_workers=0`` unless they deliver less than
half its rate, more workers must be ``min_gain`` faster to win, and whatever wins, a
setting measured slower than the loader as given by more than ``min_gain`` loses to it.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

Settings = dict[str, Any]

#: What the search keeps when every candidate failed: loading in the training process.
IN_PROCESS: Settings = {
    "num_workers": 0,
    "pin_memory": False,
    "persistent_workers": False,
    "prefetch_factor": None,
}


def worker_counts(budget: int) -> list[int]:
    """The worker counts to try: 0, the powers of two up to ``budget``, and ``budget``.

    Example::

        >>> worker_counts(6)
        [0, 1, 2, 4, 6]
        >>> worker_counts(0)
        [0]
    """
    counts, n = [0], 1
    while n <= budget:
        counts.append(n)
        n *= 2
    if counts[-1] != budget:
        counts.append(budget)
    return counts


def candidate(num_workers: int, pin_memory: bool) -> Settings:
    """The settings tried at ``num_workers``: persistent workers with the default prefetch,
    or none of those without workers; ``pin_memory`` where there is CUDA to pin for."""
    return {
        "num_workers": num_workers,
        "pin_memory": pin_memory,
        "persistent_workers": num_workers > 0,
        "prefetch_factor": 2 if num_workers > 0 else None,
    }


def beats(rate: float, best_rate: float, min_gain: float) -> bool:
    """Whether ``rate`` is more than ``min_gain`` (0.05 = 5%) faster than ``best_rate``.

    Example::

        >>> beats(10.6, 10.0, 0.05), beats(10.4, 10.0, 0.05)
        (True, False)
    """
    return rate > best_rate * (1 + min_gain)


def choose(
    given: tuple[Settings, float | None],
    in_process: tuple[Settings, float],
    workers: tuple[Settings, float],
    min_gain: float,
) -> tuple[Settings, float]:
    """The setting to use and its rate, from the loader as given, the best measured without
    workers and the best with (an empty settings dict where none was measured); an empty
    dict and 0.0 when nothing was measured at all.

    Example::

        >>> given = ({"num_workers": 0}, 10.0)
        >>> choose(given, ({"num_workers": 0}, 10.0), ({"num_workers": 1}, 9.6), 0.05)
        ({'num_workers': 1}, 9.6)
        >>> choose(given, ({"num_workers": 0}, 10.0), ({"num_workers": 1}, 8.4), 0.05)
        ({'num_workers': 0}, 10.0)
    """
    best, best_rate = workers
    # Workers load while the model trains (a step costs the longer of the two), while
    # loading in the training process adds to every step. So workers win unless their
    # hand-off costs so much that they deliver less than half the in-process rate.
    if in_process[0] and (not best or best_rate < 0.5 * in_process[1]):
        best, best_rate = in_process
    # That overlap pays only when the model's step takes time of its own, which the
    # loader alone does not show. Measured slower than the loader as given beyond the
    # noise band, a setting would make training slower than doing nothing: keep the
    # loader as given.
    given_settings, given_rate = given
    if given_rate is not None and (not best or beats(given_rate, best_rate, min_gain)):
        if best:
            log.info("num_workers: %s measured %.2fx the loader as given; keeping it as given",
                     best, best_rate / given_rate)  # fmt: skip
        return given_settings, given_rate
    return best, best_rate
