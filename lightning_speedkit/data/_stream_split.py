"""Whether an ``IterableDataset`` splits its stream among a loader's workers.

A map-style dataset's sampler hands each worker its own indices; an ``IterableDataset``
is copied into every worker, and each copy yields the whole stream unless it splits it
itself (``torch.utils.data.get_worker_info()``, webdataset's ``split_by_worker``). Two
workers over one that does not yield every sample twice, and read twice as fast: a
search for the fastest worker count took that for a speed-up, and every epoch after
trained on each sample twice, silently.

Comparing what two workers read is not enough by itself: a stream that shuffles its own
order (``random.shuffle`` in ``__iter__``) reads the same samples in each worker in
another order, because torch seeds Python's, torch's and NumPy's generators differently
in each worker (and ``get_worker_info().seed`` differs too). So the check gives both
workers worker 0's seeds, after the loader's ``worker_init_fn`` as well as before it:
then the only thing that tells the two copies apart is the worker's id (and number), and
a stream that does not consult them, split by them or not, reads the same. The first
:data:`SAMPLES` samples of each worker are compared as sets: any sample both read means
the stream is not split (a split one gives each sample to one worker). A stream whose
order comes from a source no seed reaches (the clock, ``os.urandom``) and that does not
split is told apart only when the two workers' first samples meet, as they do over a short
stream; that is the one case this check can miss. Where the check cannot run (the
workers fail), more than one worker is not tried either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import pickle
import random
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_speedkit.data._candidate_timing import describe_failure

__all__ = ["SAMPLES", "why_not_split"]

#: Samples read from each of the two workers.
SAMPLES = 8


def why_not_split(loader: DataLoader[Any], timeout: float = 30.0) -> str | None:
    """Why ``loader``'s ``IterableDataset`` must not be read by more than one worker: a
    sentence, or None where its stream is split among workers (or it is not an
    ``IterableDataset``). Starts two workers, each for :data:`SAMPLES` samples, under
    worker 0's random seeds; a worker that gives no sample within ``timeout`` seconds
    fails the check."""
    if not isinstance(loader.dataset, IterableDataset):
        return None
    try:
        first, second = _first_samples(loader, SAMPLES, timeout)
    except Exception as exc:  # a worker's error, whatever the dataset raises
        return (
            "could not tell whether the IterableDataset splits its stream among workers (two "
            f"workers reading it: {describe_failure(exc)}), so more than one worker might repeat "
            "every sample"
        )
    shared = len(set(first) & set(second))
    if not shared:
        return None  # a sample for one worker only, or none for one: split by worker
    return (
        "the IterableDataset gives every worker the whole stream (two workers given the same "
        f"random seeds read {shared} of the same samples among their first {SAMPLES}), so more "
        "than one worker would repeat every sample"
    )


def _first_samples(loader: DataLoader[Any], per_worker: int, timeout: float) -> list[list[bytes]]:
    """The keys of the first ``per_worker`` samples each of two workers reads, in order."""
    two = DataLoader(
        loader.dataset, batch_size=None, num_workers=2, collate_fn=_tagged, timeout=timeout,
        worker_init_fn=_SameSeeds(loader.worker_init_fn),
        multiprocessing_context=loader.multiprocessing_context,
    )  # fmt: skip
    samples: list[list[bytes]] = [[], []]
    iterator = iter(two)  # samples come from the workers in turn while both have some
    try:
        for worker, sample in itertools.islice(iterator, 2 * per_worker):
            if len(samples[worker]) < per_worker:
                samples[worker].append(sample_key(sample))
    finally:
        del iterator  # its workers stop with it
    return samples


def _tagged(sample: Any) -> tuple[int, Any]:
    """The sample with the id of the worker that read it (runs in the worker)."""
    info = get_worker_info()
    return (info.id if info is not None else 0, sample)


class _SameSeeds:
    """A ``worker_init_fn`` that gives every worker worker 0's random seeds, before and
    after the loader's own (which may seed from the worker's seed or id)."""

    def __init__(self, init: Callable[[int], None] | None) -> None:
        self.init = init

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        seed = info.seed - info.id if info is not None else torch.initial_seed()
        _seed_all(seed)
        if self.init is not None:
            self.init(worker_id)
        _seed_all(seed)


def _seed_all(seed: int) -> None:
    """Seed this worker's generators (Python's, torch's, NumPy's, and the seed
    ``get_worker_info()`` reports) as torch seeds worker 0's."""
    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    # torch offers no way to set the seed get_worker_info() reports: its module global
    # holds the worker's WorkerInfo (a frozen dataclass in torch 2.13). Where that ever
    # changes, the seed it reports stays the worker's own: the check then tells a stream
    # that shuffles by that seed without splitting apart only by its samples meeting.
    from torch.utils.data._utils import worker

    info = getattr(worker, "_worker_info", None)
    if isinstance(info, worker.WorkerInfo) and dataclasses.is_dataclass(worker.WorkerInfo):
        worker._worker_info = dataclasses.replace(info, seed=seed)


def sample_key(sample: Any) -> bytes:
    """A digest of ``sample``'s content: equal samples (tensors and arrays by dtype, shape
    and bytes; mappings, sequences and other values by their parts) get equal keys.

    Example::

        >>> sample_key({"x": torch.arange(3)}) == sample_key({"x": torch.arange(3)})
        True
        >>> sample_key(torch.arange(3)) == sample_key(torch.arange(3.0))
        False
    """
    digest = hashlib.blake2b(digest_size=16)
    _feed(digest, sample)
    return digest.digest()


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"tensor {value.dtype} {tuple(value.shape)}".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    elif type(value).__module__ == "numpy" and hasattr(value, "tobytes"):
        digest.update(f"array {value.dtype} {getattr(value, 'shape', ())}".encode())
        digest.update(value.tobytes())
    elif isinstance(value, Mapping):
        digest.update(f"mapping {len(value)}".encode())
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__} {len(value)}".encode())
        for item in value:
            _feed(digest, item)
    elif isinstance(value, (str, bytes, int, float, bool, type(None))):
        digest.update(f"{type(value).__name__} {value!r}".encode())
    else:  # a PIL image, an object of the user's: as it came from the worker
        digest.update(pickle.dumps(value))
