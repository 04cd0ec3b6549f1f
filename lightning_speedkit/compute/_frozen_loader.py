"""Which samples a batch holds: the dataset index carried through the loader, or a field.

``key="index"``: the train loader is built again around the same sampler (or batch
sampler), with its dataset wrapped so that each sample comes with its index, and its
collate_fn wrapped so that the batch carries them: a dict batch gets the field
``"speedkit_index"``, a list or tuple batch one more item at its end. Whatever chooses
the indices (a shuffle, a DistributedSampler, bucketing) chooses them as before.
:class:`IndexTaker` takes them out again where the fit loop first touches the batch,
before the user's batch hooks, which see the batch as their collate_fn made it (a tuple
a tuple again). A sample the user's collate_fn drops (``None`` for an undecodable one)
takes its index with it.

``key="<field>"``: the batch's own field (a tensor or list with one id per sample).
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
import random
import sys
from collections.abc import Callable, Hashable, Mapping, MutableMapping, Sequence
from numbers import Integral
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from lightning_speedkit import _compat, _validation
from lightning_speedkit._digest import feed
from lightning_speedkit._random import random_state_kept
from lightning_speedkit._surgery import in_side_run
from lightning_speedkit.compute._frozen_layout import FieldLayout, layout
from lightning_speedkit.compute._frozen_skip import SkipPlan
from lightning_speedkit.data.rebuild import _batching
from lightning_speedkit.measure._tensor_walk import named_fields

__all__ = [
    "INDEX_FIELD",
    "IndexTaker",
    "IndexedCollate",
    "IndexedDataset",
    "SampleIndex",
    "batch_keys",
    "batch_rows",
    "dataset_fingerprint",
    "sample_index",
    "with_sample_index",
]

#: The field of a dict batch that carries the dataset indices (taken out before the model).
INDEX_FIELD = "speedkit_index"


class SampleIndex:
    """The dataset indices of a batch's samples, the rows whose cached inputs are
    stand-ins (:mod:`._frozen_skip`), and how each field's rows came from the samples
    (:mod:`._frozen_layout`; None: not seen): a plain object, so that moving the batch to a
    device, pinning it or measuring its size leaves it alone."""

    __slots__ = ("indices", "layouts", "stand_ins", "tuple_batch")

    def __init__(
        self,
        indices: list[Hashable],
        stand_ins: list[int] | None = None,
        tuple_batch: bool = False,
        layouts: dict[Hashable, FieldLayout] | None = None,
    ) -> None:
        self.indices = indices
        self.stand_ins = stand_ins or []
        self.tuple_batch = tuple_batch  # the collate_fn's batch was a tuple: give one back
        self.layouts = layouts

    def __repr__(self) -> str:
        return f"SampleIndex({self.indices}, stand_ins={self.stand_ins})"


class IndexedDataset(Dataset[Any]):
    """``dataset`` whose items come as ``(index, item, stand-in)``: with a ``plan``, a
    ready sample is built without the fields it names (``speedkit_getitem``).

    An index is whatever the sampler gives: an int (a numpy integer becomes one), or any
    other hashable a dataset takes (a file name, an ``(index, size)`` pair of a
    multi-scale sampler), which is then the sample's key as it is. A dataset that fetches
    a batch of indices at once (``__getitems__``, as Hugging Face ``datasets`` do) still
    does, for the samples built in full.
    """

    def __init__(self, dataset: Dataset[Any], plan: SkipPlan | None = None) -> None:
        self.dataset = dataset
        self.plan = plan

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def _without(self, index: Hashable) -> frozenset[str]:
        if self.plan is None or not isinstance(index, int):
            return frozenset()
        return self.plan.without(index)

    def __getitem__(self, index: Any) -> tuple[Hashable, Any, bool]:
        key = sample_key(index)
        without = self._without(key)
        if without:
            return key, self.dataset.speedkit_getitem(index, without), True  # type: ignore[attr-defined]
        return key, self.dataset[index], False

    def __getitems__(self, indices: Sequence[Any]) -> list[tuple[Hashable, Any, bool]]:
        """The samples ``indices``: those built in full fetched together when the dataset
        can (its ``__getitems__``), in the sampler's order."""
        batched = getattr(self.dataset, "__getitems__", None)
        if not callable(batched):
            return [self[index] for index in indices]
        keys = [sample_key(index) for index in indices]
        full = [i for i, key in enumerate(keys) if not self._without(key)]
        items: list[Any] = [None] * len(indices)
        fetched = batched([indices[i] for i in full]) if full else []
        if not isinstance(fetched, (list, tuple)) or len(fetched) != len(full):
            raise TypeError(
                f"FrozenFeatureCache(key='index') needs the dataset's `__getitems__` to return "
                f"one item per index, and it returned a {type(fetched).__name__}; pass "
                f"`key='<field>'`, a batch field that identifies each sample"
            )
        for i, item in zip(full, fetched, strict=True):
            items[i] = (keys[i], item, False)
        for i, item in enumerate(items):
            if item is None:
                items[i] = self[indices[i]]
        return items

    def __getattr__(self, name: str) -> Any:  # the user's dataset's own attributes
        if name == "dataset" or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)  # protocols (pickling, fetching) are this class's
        return getattr(self.dataset, name)


def sample_key(index: Any) -> Hashable:
    """A sampler's index as the key of its sample: an int for any integer (numpy's too),
    else the index itself (a string, a tuple).

    Example::

        >>> import numpy as np
        >>> sample_key(np.int64(3)), sample_key(torch.tensor(5)), sample_key("cat.jpg")
        (3, 5, 'cat.jpg')
        >>> sample_key((4, 224))  # a multi-scale sampler's (index, size)
        (4, 224)
    """
    if isinstance(index, Integral):
        return int(index)
    if getattr(index, "ndim", None) == 0:  # a 0-d tensor or array of an integer
        with contextlib.suppress(TypeError):
            return operator.index(index)
    if hasattr(index, "ndim"):  # other tensors hash by identity: their text identifies them
        return repr(index)
    try:
        hash(index)
    except TypeError:
        return repr(index)  # a list index
    return index


class IndexedCollate:
    """The user's ``collate_fn`` over the items, the indices attached to the batch."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self.collate_fn = collate_fn or default_collate

    def __call__(self, triples: list[tuple[Any, ...]]) -> Any:
        batch = self.collate_fn([t[1] for t in triples])
        kept = [t for t in triples if t[1] is not None]  # what the user's collate keeps
        stand_ins = [row for row, t in enumerate(kept) if len(t) > 2 and t[2]]
        shapes = layout([t[1] for t in kept], batch)  # which rows each sample gave each field
        index = SampleIndex([t[0] for t in kept], stand_ins, isinstance(batch, tuple), shapes)
        if isinstance(batch, MutableMapping):
            batch[INDEX_FIELD] = index
            return batch
        if isinstance(batch, Mapping):
            return {**batch, INDEX_FIELD: index}
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a list would lose them
            _validation.fail(
                "key",
                "index",
                f"cannot carry the dataset index in a namedtuple batch "
                f"({type(batch).__name__}: its fields are fixed)",
                f"pass `key='<field>'` naming one of its fields {batch._fields} that "
                f"identifies each sample, or return a dict from the dataset",
            )
        if isinstance(batch, (list, tuple)):
            return [*batch, index]
        raise TypeError(
            f"FrozenFeatureCache(key='index') needs a dict, list or tuple batch to carry the "
            f"dataset index, but the collate_fn returned a {type(batch).__name__}; pass "
            f"`key='<field>'` naming a batch field that identifies each sample"
        )


def with_sample_index(loader: DataLoader[Any], plan: SkipPlan | None = None) -> DataLoader[Any]:
    """``loader`` built again with its samples' dataset indices carried in each batch (and,
    with a ``plan``, ready samples built without the fields it names)."""
    if isinstance(loader.dataset, IterableDataset):
        _validation.fail(
            "key",
            "index",
            "needs a map-style dataset (an IterableDataset has no index)",
            "pass `key='<field>'`, a batch field that identifies each sample (an id, a file name)",
        )
    if loader.batch_size is None and loader.batch_sampler is None:
        _validation.fail(
            "key",
            "index",
            "needs a loader that batches samples (this one has batch_size=None: its dataset "
            "gives whole batches, which carry no one index per row)",
            "pass `key='<field>'`, a batch field that identifies each row (an id, a file name)",
        )
    if isinstance(loader.collate_fn, IndexedCollate):
        return loader  # carries them already
    changes: dict[str, Any] = {
        "dataset": IndexedDataset(loader.dataset, plan),
        "collate_fn": IndexedCollate(loader.collate_fn),
    }
    if type(loader) is not DataLoader:
        again = _compat.dataloader_built_again(loader, changes)
        if again is not None:
            return again
    kwargs = {
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "pin_memory_device": loader.pin_memory_device,
        **_batching(loader, loader.batch_size),
        **changes,
    }
    if loader.num_workers > 0:
        kwargs.update(
            persistent_workers=loader.persistent_workers, prefetch_factor=loader.prefetch_factor
        )
    return DataLoader(**kwargs)


class IndexTaker:
    """Takes the dataset index out of each training batch where the fit loop first
    touches it: the precision plugin's ``convert_input``, which Lightning's training loop
    calls before ``on_before_batch_transfer``. So the user's batch hooks and
    ``training_step`` get the batch their collate_fn made (``x, y = batch`` works, a tuple
    is a tuple), and :meth:`take` gives the step's index to the cache.

    Example::

        >>> class Plugin:
        ...     def convert_input(self, batch):
        ...         return batch
        >>> plugin, taker = Plugin(), IndexTaker()
        >>> taker.attach(plugin)
        >>> plugin.convert_input([torch.zeros(2), SampleIndex([7, 3], tuple_batch=True)])
        (tensor([0., 0.]),)
        >>> taker.take().indices, taker.take()
        ([7, 3], None)
        >>> taker.detach(); "convert_input" in vars(plugin)
        False
    """

    def __init__(self) -> None:
        self.taken: SampleIndex | None = None
        self._plugin: Any = None
        self._mine: Callable[[Any], Any] | None = None

    def attach(self, plugin: Any) -> None:
        self.detach()
        original = plugin.convert_input

        def convert_input(batch: Any) -> Any:
            batch, index = take_index(batch)
            if index is not None and not in_side_run():  # not a tuner's trial batch's
                self.taken = index
            return original(batch)

        plugin.convert_input = convert_input  # on the instance: its class stays as it is
        self._plugin, self._mine = plugin, convert_input

    def detach(self) -> None:
        plugin, self._plugin = self._plugin, None
        mine, self._mine = self._mine, None  # a closure: the callback pickles without it
        if plugin is not None and vars(plugin).get("convert_input") is mine:
            del plugin.convert_input
        self.taken = None

    def take(self) -> SampleIndex | None:
        """The index of the batch the loop took last, once."""
        index, self.taken = self.taken, None
        return index


def take_index(batch: Any) -> tuple[Any, SampleIndex | None]:
    """``batch`` without the index :class:`IndexedCollate` put in it, and that index (None
    when it carries none)."""
    if isinstance(batch, Mapping) and isinstance(batch.get(INDEX_FIELD), SampleIndex):
        if isinstance(batch, MutableMapping):
            return batch, batch.pop(INDEX_FIELD)
        return {k: v for k, v in batch.items() if k != INDEX_FIELD}, batch[INDEX_FIELD]
    if isinstance(batch, list) and batch and isinstance(batch[-1], SampleIndex):
        index = batch.pop()
        return (tuple(batch) if index.tuple_batch else batch), index
    return batch, None


def batch_keys(batch: Any, key: str) -> list[Hashable]:
    """The samples ``batch`` holds, by ``key`` (see :func:`batch_rows`)."""
    return batch_rows(batch, key)[0]


def batch_rows(
    batch: Any, key: str, taken: SampleIndex | None = None
) -> tuple[list[Hashable], list[int]]:
    """The samples ``batch`` holds, by ``key``, and its rows whose cached inputs are
    stand-ins. With ``key="index"``: ``taken`` (the :class:`IndexTaker`'s) or the index
    field, taken out of the batch.

    Example::

        >>> batch = {"x": torch.zeros(2), INDEX_FIELD: SampleIndex([7, 3], stand_ins=[1])}
        >>> batch_rows(batch, "index"), sorted(batch)
        (([7, 3], [1]), ['x'])
        >>> batch_rows({"id": torch.tensor([5, 6])}, "id")
        ([5, 6], [])
    """
    index = sample_index(batch, key, taken)
    return list(index.indices), list(index.stand_ins)


def sample_index(batch: Any, key: str, taken: SampleIndex | None = None) -> SampleIndex:
    """The samples ``batch`` holds, by ``key``, as a :class:`SampleIndex` (see
    :func:`batch_rows`); by a field, it knows nothing of the batch's layout."""
    if key == "index":
        index = taken if taken is not None else take_index(batch)[1]
        if index is not None:
            return index
        _validation.fail(
            "key",
            key,
            "needs the train loader the cache rebuilt, but this batch "
            "carries no dataset index (a loader the cache did not see, a "
            "collate step that drops fields, or `training_step(dataloader_iter)`)",
            "pass `key='<field>'`, a batch field that identifies each sample",
        )
    named = named_fields(batch)  # a dict, a namedtuple, a dataclass
    if named is None:
        _validation.fail(
            "key",
            key,
            f"names a batch field, but the batch is a {type(batch).__name__} without fields",
            "return a dict from the collate_fn, or pass `key='index'`",
        )
    batch = named
    if key not in batch:
        fields = ", ".join(repr(f) for f in batch)
        _validation.fail(
            "key",
            key,
            f"is not a field of the batch (its fields: {fields})",
            "pass one that identifies each sample, or `key='index'` to carry the dataset index",
        )
    value = batch[key]
    if isinstance(value, torch.Tensor):
        # SYNC: a field on an accelerator is read to the host; keep ids in a list to avoid it.
        return SampleIndex(list(value.tolist()))
    return SampleIndex(list(value))


def dataset_fingerprint(dataset: Any, probes: int = 3, drawn: set[Hashable] | None = None) -> str:
    """A hash of what identifies ``dataset`` cheaply: its type, its length, and the content
    of ``probes`` samples spread over it (the first, the middle, the last).

    It tells another dataset apart when its type, its length or one of those samples
    differs; a change confined to other samples (one image replaced, the same length) is
    not seen. Each probe is read twice, the global generators (torch's CPU one, Python's,
    NumPy's) seeded anew for each read, and only what both reads agree on is hashed: a
    field drawn from them (a caption picked among several, an augmentation) changes no
    fingerprint, so a later fit on the same data finds its features. A field drawn from a
    generator of the dataset's own is left out where the two reads differ, and hashed
    where they happen to agree. The reads draw no number of the run's (its random state
    is put back). One that raises counts by its index and the error's type. A dataset
    without a length is known by its type only. ``drawn``, when given, gets the sample's
    fields (a mapping's keys, a tuple's places) that the two reads of a probe disagreed on:
    a cached module fed one of them would be served one draw for every epoch's.

    Example::

        >>> a = torch.utils.data.TensorDataset(torch.arange(6.0))
        >>> b = torch.utils.data.TensorDataset(torch.arange(6.0) + 1)
        >>> dataset_fingerprint(a) == dataset_fingerprint(a), dataset_fingerprint(a) == dataset_fingerprint(b)
        (True, False)
    """  # noqa: E501
    digest = hashlib.blake2b(digest_size=12)
    kind = type(dataset)
    digest.update(f"{kind.__module__}.{kind.__qualname__}".encode())
    try:
        size = len(dataset)
    except TypeError:
        return digest.hexdigest()
    digest.update(f":{size}".encode())
    with random_state_kept():
        for index in sorted({0, size // 2, size - 1} if size else set())[:probes]:
            try:
                first, second = (_read_seeded(dataset, index, seed) for seed in (0, 1))
            except Exception as error:  # the fit meets it again, where the user expects it
                digest.update(f"unreadable {index}: {type(error).__name__}".encode())
                continue
            agreed = _agreed(first, second)
            feed(digest, agreed)
            if drawn is not None:
                drawn.update(_drawn_fields(agreed))
    return digest.hexdigest()


def _drawn_fields(agreed: Any) -> set[Hashable]:
    """The top-level fields of a sample's :func:`_agreed` reading that hold a ``_Drawn``."""
    if isinstance(agreed, Mapping):
        return {key for key, value in agreed.items() if _holds_drawn(value)}
    if isinstance(agreed, list):
        return {place for place, value in enumerate(agreed) if _holds_drawn(value)}
    return set()


def _holds_drawn(value: Any) -> bool:
    if isinstance(value, _Drawn):
        return True
    if isinstance(value, Mapping):
        return any(_holds_drawn(v) for v in value.values())
    return isinstance(value, list) and any(_holds_drawn(v) for v in value)


class _Drawn:
    """What stands in the fingerprint for a value two seeded reads of a sample disagree on."""


def _read_seeded(dataset: Any, index: int, seed: int) -> Any:
    # The CPU generator only: ``torch.manual_seed`` would seed the accelerators too, and a
    # CUDA generator not yet initialised (seeded lazily) would not be put back.
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)
    return dataset[index]


def _agreed(first: Any, second: Any) -> Any:
    """``first`` with each part that ``second`` does not repeat replaced by a ``_Drawn``."""
    if type(first) is not type(second):
        return _Drawn()
    if isinstance(first, torch.Tensor):
        same = first.shape == second.shape and first.dtype == second.dtype
        return first if same and torch.equal(first, second) else _Drawn()
    if isinstance(first, Mapping):
        if list(first) != list(second):
            return _Drawn()
        return {key: _agreed(first[key], second[key]) for key in first}
    if isinstance(first, (list, tuple)):
        if len(first) != len(second):
            return _Drawn()
        return [_agreed(a, b) for a, b in zip(first, second, strict=True)]
    if callable(getattr(first, "tobytes", None)):  # numpy arrays, PIL images
        same = getattr(first, "shape", None) == getattr(second, "shape", None)
        return first if same and first.tobytes() == second.tobytes() else _Drawn()
    try:
        return first if bool(first == second) else _Drawn()
    except Exception:  # no equality that says yes or no: known by its type
        return first
