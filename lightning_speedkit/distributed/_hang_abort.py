"""The watchdog's ``action="abort"``: leave in order, say why, end the process with status 75.

``os._exit``, not ``sys.exit``: the main thread is stuck (in a collective, a C call) and
would never unwind, and Python's exit would wait for threads that never end. A scheduler
(``torchrun --max-restarts``, SLURM ``--requeue``) restarts the job from its last
checkpoint on the exit status.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_speedkit.distributed._hang_store import StoreLink

__all__ = ["HANG_EXIT_CODE", "abort"]

log = logging.getLogger(__name__)

#: Exit status of every process after ``action="abort"``: ``EX_TEMPFAIL`` from sysexits.h,
#: "a temporary failure; the user is invited to retry".
HANG_EXIT_CODE = 75


def abort(
    link: StoreLink,
    world_size: int,
    wait: float,
    *,
    stacks: str | None,
    report: Path,
    exit: Callable[[int], Any],
) -> None:
    """End this process with :data:`HANG_EXIT_CODE`, once the ranks have said where they were.

    Args:
        link: This rank's side of the store; rank 0 leaves last (see
            :meth:`StoreLink.leave`), each waiting ``wait`` seconds for rank 0's report.
        world_size: The ranks in all.
        stacks: Where this rank's stacks went (None: stderr).
        report: Rank 0's report file, named in the log.
        exit: What ends the process (``os._exit``).
    """
    link.leave(world_size, wait)
    log.error(
        "HangWatchdog: a training step hung (action='abort'): ending rank %d with exit "
        "status %d. Stacks: %s; rank 0's report: %s. Restart the job from its last "
        "checkpoint; see the troubleshooting page's 'Distributed hangs'.",
        link.rank, HANG_EXIT_CODE, stacks or "printed to stderr above", report,
    )  # fmt: skip
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    exit(HANG_EXIT_CODE)
