"""Forking loader workers without handing them this process's garbage to finalize."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def garbage_kept_from_children() -> Iterator[None]:
    """Within it, processes forked from this one never collect the objects it holds now.

    A forked child inherits every object, the garbage in reference cycles that this
    process has not collected yet included, and the child's collector may finalize it
    there. Some finalizers cannot run in a child: a torch.distributed gloo process group
    left in a cycle (an FSDP model's device mesh holds one) waits in its destructor for
    threads that only the parent has, and the worker hangs before its first batch.
    ``gc.freeze`` moves every object to where no collection looks, for the moment of the
    fork; ``gc.unfreeze`` gives them back to this process's collector after, which
    finalizes them here as it would have. A program that freezes objects itself (as
    Python's documentation suggests before forking) keeps its frozen set: the garbage is
    then collected here, before the fork, instead.
    """
    if gc.get_freeze_count():
        gc.collect()
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
