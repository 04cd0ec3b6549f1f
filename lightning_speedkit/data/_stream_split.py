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
:data:`SAMPLES` samples of each worker are compared as sets: where at least half of the
distinct samples of the worker that read more are samples the other read too, the stream
is not split (a split one gives each sample to one worker; one or two equal values among
its samples, a small label or a padding sample, meet by chance and do not count).

The same seeds make one more kind of stream read the same in both workers: one that draws
its samples at random (``torch.randn`` in ``__iter__``, sampling with replacement, an
endless augmenting stream), which under each worker's own seeds never repeats, so more
workers do help it. Nothing the check reads tells it from a shuffle of a finite stream
that does not split: so both are kept to one worker, and the reason says it may be
either. Two workers read again with their own seeds settle one case: where they read the
same samples in the same order, the stream depends on neither seed nor worker, and is
certainly not split (a shuffle or random draws would differ). A dataset that splits its
stream itself or draws its samples at random says so with an attribute,
``speedkit_split_by_worker = True``, and the check is not run.

A stream whose order comes from a source no seed reaches (the clock, ``os.urandom``) and
that does not split is told apart only when the two workers' first samples meet, as they
do over a very short stream; that is the one case this check can miss. Where the check
cannot run (the workers fail), more than one worker is not tried either.

A stream must also start again with each iterator: the search reads the dataset itself
(its in-process trials) and copies of it (its workers), before training reads it. One
that reads from a source opened once, in ``__init__`` (an iterator, a generator, a pipe,
a socket, a queue), gives the trials samples that training then never sees: all of them,
where the trials reach its end. :func:`held_source` finds such a source among the
dataset's attributes without reading anything, so that the loader is left untuned. Two
kinds are let through: an in-memory file (``io.BytesIO``, ``io.StringIO``), which
:func:`kept_positions` puts back where it was after each read (this check's, each trial's),
whether ``__iter__`` rewinds it or not (each worker has its own copy); and an
``itertools`` count, cycle or endless repeat, which never runs out. A file on disk held
open stays a source used up even where ``__iter__`` rewinds it: forked workers share its
offset, and read it in turns.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import itertools
import logging
import multiprocessing.connection
import multiprocessing.queues
import pickle
import queue
import random
import socket
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_speedkit import _compat, _validation
from lightning_speedkit._digest import feed
from lightning_speedkit.data._candidate_timing import describe_failure
from lightning_speedkit.data._result_cache import cell_value

__all__ = ["SAMPLES", "held_source", "kept_positions", "says_split", "why_not_split"]

log = logging.getLogger(__name__)

#: Samples read from each of the two workers.
SAMPLES = 8


def why_not_split(loader: DataLoader[Any], timeout: float = 30.0) -> str | None:
    """Why ``loader``'s ``IterableDataset`` must not be read by more than one worker: a
    sentence, or None where its stream is split among workers, its dataset says so
    (``speedkit_split_by_worker = True``), or it is not an ``IterableDataset``. Starts two
    workers, each for :data:`SAMPLES` samples, under worker 0's random seeds (and, where
    they share samples, two more under their own seeds, to tell which case it is); a worker
    that gives no sample within ``timeout`` seconds fails the check."""
    dataset = loader.dataset
    if not isinstance(dataset, IterableDataset) or says_split(dataset):
        return None
    two = _two_workers(loader, timeout, same_seeds=True)
    try:
        with kept_positions(dataset):
            first, second = _first_samples(two, SAMPLES)
    except Exception as exc:  # a worker's error, whatever the dataset raises
        return (
            "could not tell whether the IterableDataset splits its stream among workers (two "
            f"workers reading it: {describe_failure(exc, two)}), so more than one worker might "
            "repeat every sample"
        )
    shared = len(set(first) & set(second))
    # Split, a sample goes to one worker: one or two met by chance (a label, a padding
    # sample) are equal values, not the same sample. Not split, the same seeds make most meet.
    if 2 * shared < max(len(set(first)), len(set(second))) or not shared:
        return None
    if _same_with_own_seeds(loader, timeout):
        return (
            "the IterableDataset gives every worker the whole stream (two workers read the same "
            "first samples in the same order, with their own random seeds as with the same "
            "ones), so more than one worker would repeat every sample"
        )
    return (
        f"two workers given the same random seeds read {shared} of the same samples among "
        f"their first {SAMPLES}: either the IterableDataset gives every worker the whole "
        "stream (in an order drawn from those seeds), and more than one worker would repeat "
        "its samples, or it draws its samples at random (synthetic data, sampling with "
        "replacement), and more would not"
    )


def says_split(dataset: Any) -> bool:
    """Whether ``dataset`` says that more workers read no sample twice (its attribute
    ``speedkit_split_by_worker = True``: it splits its stream itself, or draws its samples at
    random), so that the check is not run."""
    said = getattr(dataset, "speedkit_split_by_worker", False)
    return _validation.boolean("speedkit_split_by_worker", said)


def _two_workers(loader: DataLoader[Any], timeout: float, same_seeds: bool) -> DataLoader[Any]:
    """A loader of ``loader``'s dataset on two workers, one sample at a time, each tagged with
    its worker's id; ``same_seeds``: both workers get worker 0's random seeds."""
    init = _SameSeeds(loader.worker_init_fn) if same_seeds else loader.worker_init_fn
    return DataLoader(
        loader.dataset, batch_size=None, num_workers=2, collate_fn=_tagged, timeout=timeout,
        worker_init_fn=init, multiprocessing_context=loader.multiprocessing_context,
    )  # fmt: skip


def _same_with_own_seeds(loader: DataLoader[Any], timeout: float) -> bool:
    """Whether two workers with their own (different) seeds read the same samples in the same
    order: then the stream depends on neither seed nor worker, and is certainly not split.
    Different samples say nothing: a shuffle of the whole stream differs by seed too."""
    try:
        with kept_positions(loader.dataset):
            first, second = _first_samples(_two_workers(loader, timeout, same_seeds=False), SAMPLES)
    except Exception:  # the first read worked: this one failing tells nothing either way
        return False
    return bool(first) and first == second


def _first_samples(two: DataLoader[Any], per_worker: int) -> list[list[bytes]]:
    """The keys of the first ``per_worker`` samples each of ``two``'s workers reads, in order
    (``two`` reads samples one by one, each with its worker's id: :func:`_tagged`)."""
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
    _compat.report_worker_seed(seed)


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
    feed(digest, sample, other=pickle.dumps)  # a PIL image, the user's object: by content
    return digest.digest()


_QUEUES = (queue.Queue, queue.SimpleQueue, multiprocessing.queues.Queue,
           multiprocessing.queues.SimpleQueue)  # fmt: skip
#: Sources a reader uses up, by what the message calls them (an iterator last: files are).
_SOURCES: tuple[tuple[tuple[type, ...], str], ...] = (
    ((io.IOBase,), "an open file"),
    ((socket.socket,), "a socket"),
    (_QUEUES, "a queue"),
    ((multiprocessing.connection.Connection,), "a pipe"),
    ((types.GeneratorType,), "a generator"),
)


def held_source(dataset: Any, depth: int = 3) -> str | None:
    """Where ``dataset``, an ``IterableDataset``, holds a source that reading uses up (an
    iterator, a generator, an open file, a socket, a queue, a pipe), said as an attribute
    path and a kind; None when there is none (or it is no ``IterableDataset``); an in-memory
    file (``io.BytesIO``) and an endless ``itertools`` iterator are none. Looks
    ``depth`` levels into the attributes, lists, tuples and dicts, of objects, and
    ``functools.partial`` arguments and closures; reads nothing.

    Example::

        >>> class Stream(IterableDataset):
        ...     def __init__(self):
        ...         self.lines = iter(["a", "b"])
        ...     def __iter__(self):
        ...         return self.lines
        >>> held_source(Stream())
        '`lines`, an iterator (list_iterator)'
    """
    if not isinstance(dataset, IterableDataset):
        return None
    seen: set[int] = {id(dataset)}
    for path, value in _parts(dataset, "", depth, seen):
        kind = _source_kind(value)
        if kind is not None:
            name = type(value).__name__
            return f"`{path}`, {kind}" + ("" if name in kind else f" ({name})")
    return None


def _source_kind(value: Any) -> str | None:
    if isinstance(value, io.IOBase) and position(value) is not None:
        return None  # in memory: put back where it was after each read (kept_positions)
    for types_, kind in _SOURCES:
        if isinstance(value, types_):
            closed = getattr(value, "closed", False)
            return None if closed is True else kind
    if isinstance(value, _ENDLESS) and _endless(value):
        return None  # never runs out: the trials leave training as much as ever
    if hasattr(type(value), "__next__") and not isinstance(value, type):
        return "an iterator"
    return None


_ENDLESS = (itertools.count, itertools.cycle, itertools.repeat)


def _endless(value: Any) -> bool:
    """Whether an ``itertools`` count, cycle or repeat never ends (a repeat given a number of
    times does: its length hint says how many are left)."""
    try:
        value.__length_hint__()
    except (TypeError, AttributeError):  # count, cycle, repeat without `times`
        return True
    return False


def position(file: Any) -> int | None:
    """Where ``file``, an open in-memory file (``io.BytesIO``, ``io.StringIO``), is; None for
    one that cannot be put back there: closed, not seekable, or on an OS file descriptor,
    whose offset forked workers share, so that whether ``__iter__`` rewinds it or not they
    read it in turns (open it in ``__iter__``: each worker then has its own)."""
    try:
        if file.closed or not file.seekable():
            return None
        file.fileno()
    except (OSError, ValueError):  # io.UnsupportedOperation: no descriptor, in memory
        try:
            return int(file.tell())
        except (OSError, ValueError):
            return None
    return None  # a file on disk, a pipe


@contextlib.contextmanager
def kept_positions(dataset: Any, depth: int = 3) -> Iterator[None]:
    """Put every in-memory file ``dataset`` holds (:func:`position`) back where it was, on
    leaving: one that its ``__iter__`` does not rewind is read by a trial, and the next read
    (a trial, training) starts it where it was."""
    seen: set[int] = {id(dataset)}
    kept = [(part, position(part)) for _, part in _parts(dataset, "", depth, seen)
            if isinstance(part, io.IOBase)]  # fmt: skip
    try:
        yield
    finally:
        for file, where in kept:
            if where is None:
                continue
            try:
                file.seek(where)
            except (OSError, ValueError):  # closed since: nothing to put back
                log.debug("could not put %r back at %d", file, where)


_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), type, types.ModuleType,
           torch.Tensor, torch.Generator)  # fmt: skip


def _parts(value: Any, path: str, depth: int, seen: set[int]) -> Iterator[tuple[str, Any]]:
    """``(path, part)`` for each part of ``value`` down to ``depth`` levels, each once."""
    if depth == 0:
        return
    children: list[tuple[str, Any]] = []
    if isinstance(value, Mapping):
        children = [(f"{path}[{key!r}]", item) for key, item in itertools.islice(value.items(), 64)]
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = [(f"{path}[{i}]", item) for i, item in enumerate(itertools.islice(value, 64))]
    elif isinstance(value, functools.partial):
        children = [(f"{path}.args[{i}]", a) for i, a in enumerate(value.args)]
        children += [(f"{path}.keywords[{k!r}]", v) for k, v in value.keywords.items()]
    elif isinstance(value, types.FunctionType):
        cells = value.__closure__ or ()
        names = value.__code__.co_freevars
        children = [
            (f"{path}.<{name}>", cell_value(cell)) for name, cell in zip(names, cells, strict=True)
        ]
    elif isinstance(getattr(value, "__dict__", None), dict) and not isinstance(value, _LEAVES):
        prefix = f"{path}." if path else ""
        children = [(prefix + name, item) for name, item in vars(value).items()]
    for child_path, child in children:
        if id(child) in seen or isinstance(child, _LEAVES):
            continue
        seen.add(id(child))
        yield child_path, child
        if _source_kind(child) is None:
            yield from _parts(child, child_path, depth - 1, seen)
