"""The disk store of the frozen-feature cache: memory-mapped shards that outlive the process.

Features are grouped by what they depend on besides the sample: the module's name, its
weights' fingerprint, the call's signature, the dataset's fingerprint and the storage
dtype. Each group is a folder ``<directory>/<module>-<hash of all that>/`` of shards; a
shard is two files written by one process and never changed afterwards:

- ``<id>.bin``: fixed-size rows, one per sample, each the bytes of the sample's output
  leaves one after the other (each leaf's start aligned to 16 bytes);
- ``<id>.json``: the index, written last: the group it belongs to, the rows' layout
  (dtype and shape of each leaf), the row count and the samples' keys in row order.

Both are written to a hidden temporary name, flushed to the disk (``fsync``) and renamed
into place, the index after the data: a reader takes a shard only once its index exists,
and then checks the data file's size against it. A crash mid-write leaves a temporary
file or a data file without its index, neither of which is ever read. Shard names are
random (a UUID), so any number of processes (the ranks of a DDP job) write into one
folder without touching each other's files, and each reads every completed shard there
(:meth:`DiskStore.refresh` looks again for shards finished since).

A failed write (a full disk, a lost mount) drops that shard's rows, warns once and stops
writing; the rows the memory store holds are still served, and training goes on. So does
a shard that would leave less than ``min(1 GiB, 5% of the file system)`` free: the cache
never fills the disk that checkpoints and logs need.

Each group a store uses is named in its lease (:mod:`._frozen_lease`), so that
:func:`~._frozen_lease.prune_frozen_features` never removes what a running process uses.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Hashable, Iterable
from numbers import Integral
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_speedkit import _validation
from lightning_speedkit.compute._frozen_lease import Lease, folder_bytes

__all__ = ["DiskStore", "check_directory", "prepare_directory"]

log = logging.getLogger(__name__)

#: Bytes of rows a process gathers for a group before it writes them as one shard.
SHARD_BYTES = 64 * 2**20
_ALIGN = 16
#: The free space a shard must leave on the file system: at most 1 GiB, at most 5% of it.
RESERVE_BYTES, RESERVE_SHARE = 2**30, 0.05
_VERSION = 1
_FIX = (
    "pass a folder you can write to (it is created if missing), or None to keep features in memory"
)

Entry = tuple[torch.Tensor, ...]
Layout = tuple[tuple[str, tuple[int, ...]], ...]


def check_directory(directory: Any) -> Path | None:
    """``directory`` as a path, refused with the fix when it cannot hold shards. Creates
    nothing (see :func:`prepare_directory`).

    Example::

        >>> check_directory(None) is None
        True
        >>> check_directory(3)
        Traceback (most recent call last):
        ...
        lightning_speedkit.errors.SpeedkitConfigError: `directory` must be a path or None, got 3; pass a folder you can write to (it is created if missing), or None to keep features in memory.
    """  # noqa: E501
    if directory is None:
        return None
    return _validation.directory("directory", directory, fix=_FIX)


def prepare_directory(directory: Any) -> Path:
    """``directory`` created if missing, and a file written in it and removed again: an
    error that names the fix now, rather than a failed write during training."""
    path = check_directory(directory)
    assert path is not None
    error = _validation.write_error(path, f".speedkit-probe-{uuid.uuid4().hex}")
    if error is not None:
        _validation.fail(
            "directory", str(path), f"cannot be written to ({error.strerror or error})", _FIX
        )
    return path


def _write_file(path: Path, data: Iterable[bytes | memoryview]) -> None:
    """Write ``data`` to ``path``, on the disk when it returns (``fsync``)."""
    with open(path, "wb") as file:
        for chunk in data:
            file.write(chunk)
        file.flush()
        os.fsync(file.fileno())


def _layout(entry: Entry) -> Layout:
    return tuple((str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in entry)


def _offsets(layout: Layout) -> tuple[list[int], int]:
    """Each leaf's byte offset in a row, and the row's size (both multiples of 16)."""
    offsets, at = [], 0
    for dtype, shape in layout:
        offsets.append(at)
        size = torch.Size(shape).numel() * getattr(torch, dtype).itemsize
        at += -(-size // _ALIGN) * _ALIGN
    return offsets, max(at, _ALIGN)


def _plain_key(key: Any) -> Any:
    """``key`` as JSON can hold it (ints, strings, tuples of those), or None."""
    if isinstance(key, str):
        return key
    if isinstance(key, bool):
        return None
    if isinstance(key, Integral):
        return int(key)
    if isinstance(key, tuple):
        parts = [_plain_key(k) for k in key]
        return None if any(p is None for p in parts) else parts
    return None


def _from_plain(value: Any) -> Hashable:
    return tuple(_from_plain(v) for v in value) if isinstance(value, list) else value


class _Shard:
    """One completed shard, its rows mapped from the file (read on access, not loaded)."""

    def __init__(self, data: Path, layout: Layout, rows: int) -> None:
        self.layout = layout
        self.offsets, self.row_bytes = _offsets(layout)
        self.bytes = rows * self.row_bytes
        mapped = torch.from_file(str(data), shared=False, size=self.bytes, dtype=torch.uint8)
        self.rows = mapped.view(rows, self.row_bytes)

    def entry(self, row: int) -> Entry:
        out = []
        for (dtype, shape), at in zip(self.layout, self.offsets, strict=True):
            kind = getattr(torch, dtype)
            size = torch.Size(shape).numel() * kind.itemsize
            out.append(self.rows[row, at : at + size].view(kind).view(shape))
        return tuple(out)


class _Group:
    """The shards of one group (see the module docstring), and where each key's row is."""

    def __init__(self, root: Path, base: tuple[Hashable, ...]) -> None:
        self.describe = repr(base)
        digest = hashlib.blake2b(self.describe.encode(), digest_size=12).hexdigest()
        name = re.sub(r"[^A-Za-z0-9_.]+", "_", str(base[0]))[:60]
        self.path = root / f"{name}-{digest}"
        self.shards: list[_Shard] = []
        self.rows: dict[Hashable, tuple[int, int]] = {}
        self.seen: set[str] = set()
        self.bytes = 0

    def scan(self) -> None:
        """Take in the shards completed since the last look (by any process)."""
        try:
            names = sorted(p.name for p in self.path.glob("*.json"))
        except OSError:
            return
        for name in names:
            if name not in self.seen:
                self.seen.add(name)
                self.load(name.removesuffix(".json"))

    def load(self, shard: str) -> None:
        """Map shard ``shard`` when its index is whole and its data has the size it says."""
        try:
            index = json.loads((self.path / f"{shard}.json").read_text())
            layout: Layout = tuple((d, tuple(s)) for d, s in index["layout"])
            keys, data = index["keys"], self.path / f"{shard}.bin"
            if index["version"] != _VERSION or index["group"] != self.describe:
                return
            if data.stat().st_size != len(keys) * _offsets(layout)[1]:
                return
            mapped = _Shard(data, layout, len(keys))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as error:
            log.debug("FrozenFeatureCache skips shard %s: %s", self.path / shard, error)
            return
        self.seen.add(f"{shard}.json")
        self.shards.append(mapped)
        self.bytes += mapped.bytes
        for row, key in enumerate(keys):
            self.rows.setdefault(_from_plain(key), (len(self.shards) - 1, row))

    def get(self, key: Hashable) -> Entry | None:
        where = self.rows.get(key)
        return None if where is None else self.shards[where[0]].entry(where[1])


class DiskStore:
    """Shards under ``directory`` (see the module docstring): every row put is written, in
    shards of about ``shard_bytes``; rows not yet written are served from the buffer.

    Example::

        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> store = DiskStore(prepare_directory(folder))
        >>> store.put(("tower", "weights", "call"), 7, (torch.arange(4.0),))
        True
        >>> store.flush()
        >>> again = DiskStore(Path(folder))  # another process, later
        >>> again.get(("tower", "weights", "call"), 7)[0].tolist(), again.bytes
        ([0.0, 1.0, 2.0, 3.0], 16)
    """

    def __init__(self, directory: Path, shard_bytes: int = SHARD_BYTES) -> None:
        self.directory, self.shard_bytes = directory, shard_bytes
        self.failed: str | None = None  # why writing stopped
        self.lost: list[tuple[Hashable, ...]] = []  # keys whose rows were only in a failed shard
        self._groups: dict[tuple[Hashable, ...], _Group] = {}
        self._pending: dict[tuple[tuple[Hashable, ...], Layout], dict[Hashable, Any]] = {}
        self.lease = Lease(directory)

    @property
    def bytes(self) -> int:
        """Bytes of the completed shards the store serves from (any process's), in the groups
        it uses now (not those :meth:`release` let go)."""
        return sum(group.bytes for group in self._groups.values())

    def other_bytes(self) -> int:
        """Bytes of the folder's other shard data: groups this store does not use (earlier
        weights, other datasets, other jobs), and shards of its groups it has not taken in."""
        return max(folder_bytes(self.directory) - self.bytes, 0)

    def groups(self) -> list[str]:
        """The folder names of the groups this store uses now."""
        return sorted({group.path.name for group in self._groups.values()})

    def _group(self, base: tuple[Hashable, ...]) -> _Group:
        group = self._groups.get(base)
        if group is None:
            group = self._groups[base] = _Group(self.directory, base)
            self.lease.use(group.path.name)
            group.scan()
        else:
            self.lease.touch()  # at most once a minute: this process uses its groups
        return group

    def release(self, gone: Any) -> None:
        """Let go of the groups whose base ``gone(base)`` says are gone by (features of
        earlier weights, or another dataset): their rows are no longer looked up, their
        bytes no longer counted, and the lease no longer names them. Their shards stay."""
        bases = [base for base in self._groups if gone(base)]
        names = {self._groups.pop(base).path.name for base in bases}
        names -= {group.path.name for group in self._groups.values()}
        self.lease.forget(names)

    def close(self) -> None:
        """The lease removed (the groups are marked used now); the next use writes it again."""
        self.lease.close()

    def reopen(self) -> None:
        """The lease written again after :meth:`close` (a later fit of the same cache)."""
        self.lease.write()

    def get(self, base: tuple[Hashable, ...], key: Hashable) -> Entry | None:
        for (pending_base, _), rows in self._pending.items():
            if pending_base == base and key in rows:
                return rows[key][0]
        return self._group(base).get(key)

    def put(
        self, base: tuple[Hashable, ...], key: Hashable, entry: Entry, held: bool = False
    ) -> bool:
        """Buffer ``entry`` to be written (``held``: the memory store keeps it too); False
        when it cannot be: writing failed before, or the key is not made of ints and strings."""
        plain = _plain_key(key)
        if self.failed is not None or plain is None:
            return False
        if key in self._group(base).rows:
            return True  # on disk already (another rank, an earlier process)
        bucket = (base, _layout(entry))
        rows = self._pending.setdefault(bucket, {})
        rows[key] = (entry, plain, held)
        if len(rows) * _offsets(bucket[1])[1] >= self.shard_bytes:
            self._write(bucket)
        return True

    def flush(self) -> None:
        """Write every buffered row (the callback calls this at each epoch's end)."""
        for bucket in list(self._pending):
            self._write(bucket)
        self.lease.touch()

    def refresh(self) -> None:
        """Take in the shards other processes completed since the last look."""
        for group in self._groups.values():
            group.scan()

    def reject(self, name: Hashable) -> None:
        """Remove the shards of module ``name``'s groups: their features proved wrong."""
        for bucket in [b for b in self._pending if b[0][0] == name]:
            del self._pending[bucket]
        for base, group in list(self._groups.items()):
            if base[0] != name:
                continue
            for index in sorted(group.path.glob("*.json")):  # indices first: never half a shard
                for path in (index, index.with_suffix(".bin")):
                    path.unlink(missing_ok=True)
            del self._groups[base]

    def _write(self, bucket: tuple[tuple[Hashable, ...], Layout]) -> None:
        base, layout = bucket
        rows = self._pending.pop(bucket)
        if not rows or self.failed is not None:
            return
        group = self._group(base)
        offsets, row_bytes = _offsets(layout)
        data = torch.zeros(len(rows), row_bytes, dtype=torch.uint8)
        for i, (entry, _, _) in enumerate(rows.values()):
            for leaf, at in zip(entry, offsets, strict=True):
                raw = leaf.contiguous().reshape(-1).view(torch.uint8)
                data[i, at : at + raw.numel()] = raw
        index = {"version": _VERSION, "group": group.describe, "layout": layout,
                 "keys": [plain for _, plain, _ in rows.values()]}  # fmt: skip
        shard = uuid.uuid4().hex
        room = self._room(data.numel())
        if room is not None:
            self._fail(room, base, [key for key, (_, _, held) in rows.items() if not held])
            return
        try:
            self._commit(group.path, shard, ".bin", [data.numpy().data])
            self._commit(group.path, shard, ".json", [json.dumps(index).encode()])
        except OSError as error:
            self._fail(error, base, [key for key, (_, _, held) in rows.items() if not held])
            return
        group.load(shard)

    def _room(self, size: int) -> str | None:
        """Why a shard of ``size`` bytes must not be written (it would leave the file system
        with less than the reserve free); None when it may."""
        try:
            usage = shutil.disk_usage(self.directory)
        except OSError:
            return None  # the write itself says what is wrong
        reserve = min(RESERVE_BYTES, int(usage.total * RESERVE_SHARE))
        if usage.free - size >= reserve:
            return None
        return (
            f"the disk is nearly full ({usage.free / 2**20:.0f} MiB free; the cache leaves "
            f"{reserve / 2**20:.0f} MiB for checkpoints and logs)"
        )

    @staticmethod
    def _commit(folder: Path, shard: str, suffix: str, data: list[Any]) -> None:
        temporary = folder / f".{shard}{suffix}.tmp"
        try:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                _write_file(temporary, data)
            except FileNotFoundError:  # a prune removed the empty folder meanwhile
                folder.mkdir(parents=True, exist_ok=True)
                _write_file(temporary, data)
            os.replace(temporary, folder / f"{shard}{suffix}")
        finally:
            temporary.unlink(missing_ok=True)

    def _fail(self, error: OSError | str, base: tuple[Hashable, ...], lost: list[Hashable]) -> None:
        if isinstance(error, str):
            self.failed = error
        else:
            why = "the disk is full" if error.errno == errno.ENOSPC else "a write failed"
            self.failed = f"{why} ({error.strerror or error})"
        self.lost.extend((*base, key) for key in lost)
        for (other, _), rows in self._pending.items():  # nothing more is written
            self.lost.extend((*other, key) for key, (_, _, held) in rows.items() if not held)
        self._pending.clear()
        rank_zero_warn(
            f"FrozenFeatureCache stopped writing features to `directory` ({self.directory}): "
            f"{self.failed}. The features not written are run again when needed and training "
            f"goes on; free space there (`FrozenFeatureCache.prune(directory)` removes features "
            f"no run uses) or pass another `directory`."
        )
