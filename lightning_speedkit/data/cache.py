"""SampleCache: keep a map-style dataset's decoded samples in memory after their first read."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import operator
import pickle
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, IterableDataset
from tqdm.auto import tqdm

from lightning_speedkit import _compat, _validation
from lightning_speedkit.data._fork import garbage_kept_from_children
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["SampleCache", "sample_nbytes"]


def sample_nbytes(sample: Any) -> int:
    """Bytes a sample holds: its tensors', numpy arrays' and images' data, and each other
    object's own size (``sys.getsizeof``: a token id, a string), through nested lists,
    tuples, dicts and dataclasses (counted by what they hold)."""
    if isinstance(sample, torch.Tensor):
        return sample.element_size() * sample.nelement()
    if isinstance(sample, (bytes, bytearray)):
        return len(sample)
    nbytes = getattr(sample, "nbytes", None)  # numpy arrays
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(sample, Image.Image):  # torchvision-style datasets' samples
        return sample.width * sample.height * _PIXEL_BYTES.get(sample.mode, 4)
    if isinstance(sample, Mapping):
        return sum(sample_nbytes(v) for v in sample.values())
    if isinstance(sample, Sequence) and not isinstance(sample, str):
        return sum(sample_nbytes(v) for v in sample)
    if dataclasses.is_dataclass(sample) and not isinstance(sample, type):
        return sum(sample_nbytes(getattr(sample, f.name)) for f in dataclasses.fields(sample))
    return sys.getsizeof(sample)


#: Bytes per pixel Pillow keeps for an image mode: one for one-byte modes, two for 16-bit
#: ones, and four for the rest (RGB and the other multi-band modes are stored four wide).
_PIXEL_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16L": 2, "I;16B": 2, "I;16N": 2}


class SampleCache(Dataset[Any]):
    """A map-style dataset whose samples are read once, then served from memory.

    For datasets whose ``__getitem__`` is costly (JPEG decoding, resizing,
    tokenizing) and small enough to hold: from the second epoch on, a sample costs a
    dictionary look-up. Samples come back exactly as the dataset first returned them,
    so training sees the same data in the same order.

    What to know:

    - The dataset's ``__getitem__`` must be deterministic: random augmentation
      inside it would be frozen at its first draw. Augment after the cache (in the
      collate function or on the device) instead.
    - Samples are shared, not copied: do not modify them in place (a collate
      function that stacks or pads makes new tensors, as the default one does).
    - The cache lives in the process that reads: with ``num_workers=0``, the main
      process; with workers, each worker keeps its own (pickling the cache to spawned
      workers is skipped, they start empty), so memory is up to one cache per worker
      and each warms up separately. It pays most where the loader runs in-process,
      or with few persistent workers.
    - ``max_bytes`` bounds the bytes held per process (:func:`sample_nbytes`: tensors,
      arrays and images by their data, other objects by their size, a list of token
      ids included); samples beyond it are read from the dataset each time.
      ``None``: no bound.
    - In-process, the first epoch still decodes one sample after another between
      steps. :meth:`warm` reads the samples ahead of training in parallel worker
      processes instead, so that every epoch runs at the cache's speed.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        max_bytes: most bytes of samples to keep per process, or None.

    Example::

        >>> import torch
        >>> class Squares(torch.utils.data.Dataset):
        ...     reads = 0
        ...     def __len__(self): return 4
        ...     def __getitem__(self, i):
        ...         Squares.reads += 1
        ...         return torch.tensor([i * i])
        >>> cached = SampleCache(Squares())
        >>> [int(cached[i]) for i in (0, 1, 2, 3, 0, 1, 2, 3)]
        [0, 1, 4, 9, 0, 1, 4, 9]
        >>> Squares.reads, cached.hits, cached.misses
        (4, 4, 4)
    """

    def __init__(self, dataset: Dataset[Any], max_bytes: int | None = None) -> None:
        if (
            isinstance(dataset, IterableDataset)
            or not hasattr(dataset, "__len__")
            or not hasattr(dataset, "__getitem__")
        ):
            raise SpeedkitConfigError(
                f"SampleCache needs a map-style dataset (__getitem__ and __len__); got a "
                f"{type(dataset).__name__}. Iterable datasets have no index to cache by."
            )
        if max_bytes is not None and (
            isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0
        ):
            raise SpeedkitConfigError(
                f"`max_bytes` must be None or a non-negative int, got {max_bytes!r}."
            )
        self.dataset = dataset
        self.max_bytes = max_bytes
        self._samples: dict[int, Any] = {}
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.warmed = 0
        """Samples :meth:`warm` read and kept (not counted as misses)."""
        self._full = False  # warm stopped at max_bytes: a later warm has nothing to add

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        key = _key(index)
        sample = self._samples.get(key, _MISSING) if key is not None else _MISSING
        if sample is not _MISSING:
            self.hits += 1
            return sample
        self.misses += 1
        sample = self.dataset[index]
        if key is not None:
            self._keep(key, sample)
        return sample

    def speedkit_getitem(self, index: int, without: frozenset[str]) -> Any:
        """Sample ``index`` for a loader that needs no ``without`` fields of it (the
        frozen-feature cache's protocol): the kept sample as it is when in memory (it
        costs nothing), else the wrapped dataset's own ``speedkit_getitem`` where it has
        one (not kept: it lacks those fields), else read and kept as ``__getitem__`` does."""
        key = _key(index)
        if key is not None and key in self._samples:
            return self[index]
        skip = getattr(self.dataset, "speedkit_getitem", None)
        if callable(skip):
            return skip(index, without)
        return self[index]

    def _keep(self, index: int, sample: Any) -> bool:
        """Keep ``sample`` if the budget has room; whether it was kept."""
        size = sample_nbytes(sample)
        if self.max_bytes is not None and self.nbytes + size > self.max_bytes:
            return False
        self._samples[index] = sample
        self.nbytes += size
        return True

    def warm(
        self,
        num_workers: int = 2,
        *,
        chunk_size: int = 64,
        progress: bool = True,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
    ) -> int:
        """Read every sample not yet cached now, in ``num_workers`` processes.

        Without it, an in-process loader's first epoch decodes each batch's samples
        one after another between training steps, on one core. ``warm`` decodes them
        before training, on as many cores as it is given, in index order, each through
        the same ``__getitem__``: the samples kept are equal to what the first epoch
        would read. It stops at the first sample that does not fit in ``max_bytes``
        (with a budget, which samples are kept then differs from a shuffled first
        epoch's); the rest are read during training as before, and a later ``warm``
        reads nothing. torch's global random state is left as it was.

        Workers send each chunk of ``chunk_size`` samples pickled, so the samples kept
        are ordinary tensors of this process (not shared-memory segments, one file
        descriptor each). ``worker_init_fn`` finds the dataset's own attributes on
        ``get_worker_info().dataset``, as in a loader over the cache. Forked workers
        start with this process's objects frozen (``gc.freeze``), so they never finalize
        its uncollected garbage: a gloo process group left in a cycle hangs a worker that
        does.

        Args:
            num_workers: processes that read samples (no more than there are chunks);
                0 reads them in this process. On 2 cores one worker was slower than
                none (it pays for sending the samples back) and two faster
                (``benchmarks/cache_warm.py``).
            chunk_size: samples per message from a worker: larger sends fewer
                messages, smaller spreads a small dataset over more workers.
            progress: show a progress bar.
            worker_init_fn: as the DataLoader's (e.g. to open files per worker).
            multiprocessing_context: as the DataLoader's ("spawn", "fork", ...).

        Returns:
            How many samples were kept.

        Example::

            >>> import torch
            >>> class Squares(torch.utils.data.Dataset):
            ...     def __len__(self): return 100
            ...     def __getitem__(self, i): return torch.tensor([i * i])
            >>> cached = SampleCache(Squares())
            >>> cached.warm(num_workers=0, progress=False)
            100
            >>> int(cached[7]), cached.hits, cached.misses
            (49, 1, 0)
        """
        _validation.non_negative_int("num_workers", num_workers, example=2)
        _validation.positive_int("chunk_size", chunk_size, example=64)
        _validation.boolean("progress", progress)
        if self._full:
            return 0
        todo = [i for i in range(len(self.dataset)) if i not in self._samples]
        if not todo:
            return 0
        workers = min(num_workers, math.ceil(len(todo) / chunk_size))
        kept = 0
        workers_iterator: Any = None
        chunks: Iterator[list[tuple[int, Any]]]
        bar = tqdm(total=len(todo), desc="Warming the sample cache", unit="sample",
                   disable=not progress)  # fmt: skip
        try:
            if workers == 0:  # read here: nothing to send between processes
                chunks = ([(i, self.dataset[i])] for i in todo)
            else:
                loader = DataLoader(
                    _Indexed(self.dataset, todo), batch_size=chunk_size, num_workers=workers,
                    collate_fn=_pickled, worker_init_fn=worker_init_fn,
                    multiprocessing_context=multiprocessing_context,
                    generator=torch.Generator(),  # its base seed, not one from the global state
                )  # fmt: skip
                with garbage_kept_from_children():  # the workers start here
                    workers_iterator = iter(loader)
                chunks = map(pickle.loads, workers_iterator)
            for chunk in chunks:
                bar.update(len(chunk))
                for index, sample in chunk:
                    if index in self._samples:
                        continue
                    if not self._keep(index, sample):
                        self._full = True
                        break
                    kept += 1
                if self._full:
                    break
        finally:
            bar.close()
            self.warmed += kept
            if workers_iterator is not None:
                # End the workers here, on an error too: the error's traceback holds the
                # iterator, whose own end would wait for the traceback to go.
                _, shutdown = _compat.loader_iterator_workers(workers_iterator)
                if shutdown is not None:
                    shutdown()
        return kept

    def __getstate__(self) -> dict[str, Any]:
        # Spawned workers get the dataset, not the (possibly large) cache.
        state = dict(self.__dict__)
        state["_samples"], state["nbytes"], state["hits"], state["misses"] = {}, 0, 0, 0
        state["warmed"], state["_full"] = 0, False
        return state

    def clear(self) -> None:
        """Drop every cached sample (e.g. after the files behind the dataset changed)."""
        self._samples.clear()
        self.nbytes = 0
        self._full = False

    def __getattr__(self, name: str) -> Any:
        # The wrapped dataset's own attributes (e.g. ``caption_lengths``) stay reachable.
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


_MISSING = object()


def _key(index: Any) -> Any:
    """What a sample is kept under: ``3``, ``np.int64(3)`` and ``torch.tensor(3)`` alike;
    None for an index that is read through, never kept.

    Samplers yield indices of all three kinds (``SubsetRandomSampler`` over
    ``torch.where(mask)[0]``, a permutation tensor as the sampler). Any other tensor is
    read through: it hashes by identity, so kept under itself it would never be found
    again and the cache would grow at every read, and ``tensor([3])`` fetches a batch of
    one, not sample 3. So is an unhashable index (a list). A key of the dataset's own
    (a str, a tuple) is kept under itself.
    """
    if isinstance(index, int):
        return index
    if getattr(index, "ndim", 0) == 0:
        with contextlib.suppress(TypeError):  # not an integer
            return operator.index(index)
    if isinstance(index, torch.Tensor):
        return None
    try:
        hash(index)
    except TypeError:
        return None
    return index


class _Indexed(Dataset[tuple[int, Any]]):
    """The dataset's samples at ``indices``, each with its index (for :meth:`SampleCache.warm`)."""

    def __init__(self, dataset: Dataset[Any], indices: list[int]) -> None:
        self.dataset = dataset
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> tuple[int, Any]:
        index = self.indices[position]
        return index, self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        # A worker_init_fn reaches the dataset's own attributes (``.open()``, a path)
        # through ``get_worker_info().dataset``, as it does in a loader over the cache.
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


class _ByValue(pickle.Pickler):
    """Pickles CPU tensors as numpy arrays: their bytes in one piece, not a torch.save each.

    A dtype numpy lacks (bfloat16, the float8s) travels as its raw bytes. torch's own
    pickling is not used for these either: in torch 2.13 it fails on uint16, uint32,
    uint64 and the float8s ("UntypedStorage has no attribute dtype"), which a
    nanoGPT-style dataset of uint16 token ids would hit.
    """

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is not torch.Tensor
            or obj.device.type != "cpu"
            or obj.requires_grad
            or obj.layout != torch.strided
            or obj.is_quantized
        ):
            return NotImplemented
        obj = obj.resolve_conj().resolve_neg()  # a lazy conjugate or negation: numpy() refuses
        if obj.dtype in _NUMPY_DTYPES:
            return torch.from_numpy, (obj.numpy(),)
        raw = obj.contiguous().reshape(-1).view(torch.uint8).numpy()
        return _from_bytes, (raw, obj.dtype, tuple(obj.shape))


def _from_bytes(raw: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(raw).view(dtype).reshape(shape)


_NUMPY_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
    torch.complex64, torch.complex128,
}  # fmt: skip


def _pickled(chunk: list[tuple[int, Any]]) -> bytes:
    """A worker's chunk as bytes: tensors travel by value, not as shared memory."""
    buffer = io.BytesIO()
    _ByValue(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(chunk)
    return buffer.getvalue()
