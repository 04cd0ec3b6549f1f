"""The worker search's results on disk, one file per loader, machine, worker budget and
torch version; only measured results are written, and one reached by failures is not read.

A result holds for a loader whose batches cost what they cost when it was measured. The
key is a hash of what that cost depends on, as the loader's objects show it, read
without loading anything: the dataset's class and the code of its ``__getitem__`` (or
``__iter__``), its attributes in turn (a ``Subset``'s dataset and indices, a
``ConcatDataset``'s parts, a transform function's code, defaults and closure, a
transform object's class, code and attributes; tensors and arrays by dtype and shape,
and integer ones, index lists, by content), the sampler and batch sampler, the
``collate_fn`` and ``worker_init_fn`` by code, the loader's own worker settings and
multiprocessing context, and the dataset's own ``fingerprint`` where it has one. Two
``Subset``s of one dataset class, one with a 4 ms transform and one with none, once
shared an entry: the heavy one was given the light one's choice, and its rate.

The key is the same from one run of a script to the next: code is read as compiled,
sets in a stable order, objects by their attributes, never by address. An attribute that
differs from run to run (a temporary directory, a time) gives each run its own entry: it
measures again. What the objects do not show is not in the key: files on disk changed
in place (bigger images under the same names) keep the entry; ``force=True`` measures
again, and a dataset's ``fingerprint`` (a data version) tells them apart for good.
"""

from __future__ import annotations

import array
import enum
import functools
import hashlib
import itertools
import json
import numbers
import os
import platform
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_speedkit.data.tune_result import TuneResult
from lightning_speedkit.data.worker_cores import cpu_budget

# 3: results chosen against the loader as given, and only measured ones cached (entries
# of version 2 may hold a num_workers=0 that every candidate failing had forced).
CACHE_VERSION = 3


def fingerprint(loader: DataLoader[Any], local_world_size: int, budget: int) -> str:
    """The name of ``loader``'s cache entry: what makes a measured result hold (what the
    loader's batches cost, see the module's docstring; machine, cores, worker budget,
    device, torch)."""
    dataset = loader.dataset
    custom = getattr(dataset, "fingerprint", None)
    parts = {
        "version": CACHE_VERSION,
        "dataset": f"{type(dataset).__module__}.{type(dataset).__qualname__}",
        "dataset_fingerprint": custom() if callable(custom) else custom,
        "len": len(dataset) if hasattr(dataset, "__len__") else None,
        "batch_size": loader.batch_size,
        "loading": loading(loader),
        "machine": platform.node(),
        "cores": cpu_budget(1),
        "local_world_size": local_world_size,
        "worker_budget": budget,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def loading(loader: DataLoader[Any]) -> dict[str, Any]:
    """What ``loader``'s batches cost depends on, as plain data (the same from run to run).

    Example::

        >>> from torch.utils.data import Subset, TensorDataset
        >>> data = TensorDataset(torch.zeros(8, 2))
        >>> a, b = (DataLoader(Subset(data, i)) for i in (range(4), range(4, 8)))
        >>> loading(a) == loading(DataLoader(Subset(data, range(4)))), loading(a) == loading(b)
        (True, False)
    """
    describe = _Describer()
    context = loader.multiprocessing_context
    given = [loader.num_workers, loader.pin_memory, loader.persistent_workers,
             loader.prefetch_factor, loader.drop_last, getattr(loader, "in_order", True),
             context.get_start_method() if context is not None else None]  # fmt: skip
    return {
        "loader": _name(type(loader)),
        "dataset": describe(loader.dataset),
        "sampler": describe(loader.sampler),
        "batch_sampler": describe(loader.batch_sampler),
        "collate_fn": describe(loader.collate_fn),
        "worker_init_fn": describe(loader.worker_init_fn),
        "given": given,
    }


def _name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=12).hexdigest()


#: Methods whose code is what a dataset, sampler or transform costs, where a class has them.
_COSTLY = ("__getitem__", "__getitems__", "__iter__", "__call__", "forward")
#: Objects that say nothing about loading and change from run to run: their type only.
_OPAQUE = (pl.Trainer, pl.LightningModule, pl.Callback)
#: Most items of a container, and most index values hashed, before only its size counts.
_ITEMS, _INDICES = 64, 1 << 20


class _Describer:
    """Plain data for a value and what it holds, ``budget`` objects deep at most; an object
    met again is named by the order it was first met in (cycles, a sampler's dataset)."""

    def __init__(self, budget: int = 4000) -> None:
        self.left = budget
        self.met: dict[int, int] = {}
        self.kept: list[Any] = []  # what was met stays alive, so its id means it alone

    def __call__(self, value: Any, depth: int = 6) -> Any:
        if isinstance(value, str) and len(value) > 256:
            return ["str", len(value), _digest(value.encode(errors="replace"))]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (bytes, bytearray)):
            return ["bytes", len(value), _digest(bytes(value[:_INDICES]))]
        if isinstance(value, (numbers.Number, enum.Enum, range, slice)):
            return repr(value)
        if isinstance(value, os.PathLike):
            return ["path", os.fspath(value)]
        if isinstance(value, (type, types.ModuleType)):
            return ["type", _name(value) if isinstance(value, type) else value.__name__]
        if isinstance(value, torch.Tensor) or type(value).__module__ == "numpy":
            return _array(value)
        if isinstance(value, _OPAQUE):
            return ["opaque", _name(type(value))]
        if depth == 0 or self.left <= 0:
            return ["deeper", _name(type(value))]
        if id(value) in self.met:
            return ["met", self.met[id(value)]]
        self.met[id(value)] = len(self.met)
        self.kept.append(value)
        self.left -= 1
        return self._parts(value, depth - 1)

    def _parts(self, value: Any, depth: int) -> Any:
        if isinstance(value, types.FunctionType):
            cells = [cell_value(cell) for cell in value.__closure__ or ()]
            return ["function", value.__module__, value.__qualname__, _code(value.__code__),
                    self(value.__defaults__, depth), self(value.__kwdefaults__, depth),
                    self(cells, depth)]  # fmt: skip
        if isinstance(value, types.MethodType):
            return ["method", self(value.__self__, depth), self(value.__func__, depth)]
        if isinstance(value, functools.partial):
            return ["partial", self(value.func, depth), self(value.args, depth),
                    self(value.keywords, depth)]  # fmt: skip
        if callable(value) and not hasattr(value, "__dict__"):  # builtins: by name
            name = getattr(value, "__qualname__", None)
            return ["builtin", _name(type(value)), getattr(value, "__module__", None), name]
        if isinstance(value, Mapping):
            # Only the first items: an h5py or zarr group, a lazy dict opens each one listed.
            first = itertools.islice(value.items(), _ITEMS)
            items = [[self(k, depth), self(v, depth)] for k, v in first]
            return ["mapping", len(value), items]
        if isinstance(value, (set, frozenset)):
            if len(value) > _ITEMS:  # which ones would come first differs from run to run
                return ["set", len(value)]
            return ["set", sorted(json.dumps(self(v, depth), default=str) for v in value)]
        if isinstance(value, (list, tuple)):
            return [type(value).__name__, len(value), *self._sequence(value, depth)]
        state = vars(value) if isinstance(getattr(value, "__dict__", None), dict) else {}
        return ["object", _name(type(value)), _methods(type(value)),
                [[name, self(item, depth)] for name, item in state.items()]]  # fmt: skip

    def _sequence(self, value: list[Any] | tuple[Any, ...], depth: int) -> list[Any]:
        if 0 < len(value) <= _INDICES and all(type(v) is int for v in value):  # indices
            try:
                return ["ints", _digest(array.array("q", value).tobytes())]
            except OverflowError:
                return ["ints", _digest(repr(value).encode())]
        return [self(v, depth) for v in value[:_ITEMS]]


def _array(value: Any) -> list[Any]:
    """A tensor or array (or NumPy scalar) by dtype and shape; an integer one, a list of
    indices, by its content too (up to a million values)."""
    shape = list(getattr(value, "shape", ()))
    kind = ["array", str(getattr(value, "dtype", type(value).__name__)), shape]
    dtype_kind = getattr(getattr(value, "dtype", None), "kind", "")
    try:
        if isinstance(value, torch.Tensor):
            integer = not value.is_floating_point() and not value.is_complex()
            if integer and value.numel() <= _INDICES:
                flat = value.detach().cpu().contiguous().reshape(-1)
                kind.append(_digest(flat.view(torch.uint8).numpy().tobytes()))
        elif dtype_kind in ("i", "u", "b") and getattr(value, "size", _INDICES + 1) <= _INDICES:
            kind.append(_digest(value.tobytes()))
    except (RuntimeError, TypeError, AttributeError):  # sparse, meta, quantized: by shape
        pass
    return kind


def _methods(kind: type) -> list[Any]:
    """The code of ``kind``'s :data:`_COSTLY` methods, where it has them (inherited too)."""
    found = []
    for name in _COSTLY:
        method = getattr(kind, name, None)
        if isinstance(method, types.FunctionType):
            found.append([name, method.__qualname__, _code(method.__code__)])
    return found


def _code(code: types.CodeType) -> str:
    """The compiled code, its names and constants (nested functions' code in turn)."""
    consts = []
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            consts.append(_code(const))
        elif isinstance(const, frozenset):  # `x in {"a", "b"}`: its order varies by run
            consts.append(repr(sorted(map(repr, const))))
        else:
            consts.append(repr(const))
    return _digest(code.co_code + repr((code.co_names, consts)).encode())


def cell_value(cell: Any) -> Any:
    """A closure cell's value (None for an empty cell)."""
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lightning_speedkit/num_workers`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning_speedkit" / "num_workers"


def read_cache(path: Path) -> TuneResult | None:
    """The result kept at ``path``; None when there is none, it cannot be read, or a
    candidate failed in it (a choice failures forced is measured again)."""
    try:
        data = json.loads(path.read_text())
        data.update(cached=True, seconds=0.0)
        result = TuneResult(**data)
    except (OSError, ValueError, TypeError):  # missing or unreadable: measure again
        return None
    if any(row.get("skipped") for row in result.table):  # reached by failures: measure again
        return None
    return result


def write_cache(path: Path, result: TuneResult) -> None:
    """Keep ``result`` at ``path`` (written whole, then moved into place); a cache that
    cannot be written is said once and costs the next run a search, nothing more."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result.to_json(), indent=2))
        tmp.replace(path)
    except OSError as exc:  # a cache that cannot be written costs a retune, nothing more
        rank_zero_warn(
            f"NumWorkersTuner: could not write its cache at {path} ({exc}); tuning will run again."
        )
