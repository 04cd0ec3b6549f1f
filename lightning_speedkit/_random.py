"""Work the kit does on the user's behalf draws no number the user's run would have drawn.

A seeded run (``L.seed_everything(0)``) shuffles its loader with a seed drawn from torch's
global generator as each epoch starts: a kit callback that draws from it before (a
synthetic input for a parity check, a matmul timed for the peak FLOP/s, a trial loader's
shuffle) changes the data order, and with it every loss, though it changes no number of
the model's. Such work runs inside :func:`random_state_kept`.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["loader_generators", "random_state_kept"]


@contextlib.contextmanager
def random_state_kept(generators: Iterable[torch.Generator] = ()) -> Iterator[None]:
    """Torch's global generator (and each initialised CUDA device's), Python's, NumPy's
    and ``generators`` (a loader's own) are put back as they were when the block ends.

    Example::

        >>> _ = torch.manual_seed(0)
        >>> with random_state_kept():
        ...     _ = torch.randn(3)  # the kit's draws
        >>> after = torch.randn(1)
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(after, torch.randn(1))  # the run's first draw, as without the kit
        True
    """
    kept = [(g, g.get_state()) for g in generators]
    torch_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")  # imported by the user or a library: its state is theirs
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        random.setstate(python_state)
        if numpy is not None and numpy_state is not None:
            numpy.random.set_state(numpy_state)
        for generator, state in kept:
            generator.set_state(state)


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The random generators of ``loader`` that loaders built from it share and advance.

    A loader rebuilt for a trial reuses the loader's generator and its sampler objects, so
    a sampler with its own generator (``RandomSampler(ds, generator=g)``) would be drawn
    from by every trial iteration and shuffle the real first epoch differently.
    """
    holders = [loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
               getattr(getattr(loader, "batch_sampler", None), "sampler", None)]  # fmt: skip
    found: list[torch.Generator] = []
    for holder in holders:
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found
