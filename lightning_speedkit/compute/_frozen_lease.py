"""The disk store's upkeep: which groups running processes use, what the folder holds, pruning.

A disk store's folder (:mod:`._frozen_disk`) keeps the features of every weights, dataset,
dtype and call signature it was ever given: a tower trained again, a dataset edited, a
second experiment sharing the folder each add a group of shards, and nothing removes
them by itself (another job may still want the pretrained tower's features).
:func:`prune_frozen_features` removes the groups nobody has used for a while, or the least
recently used ones down to a size, and never those a running process uses:

- **In use.** Each process with a disk store keeps a lease, ``<directory>/.leases/<id>.json``,
  naming the group folders it serves from or writes to. It rewrites the lease at most once
  a minute while it looks features up or stores them (and at each epoch's end), and
  removes it when the fit ends. A lease rewritten within the last hour marks its groups in
  use; an older one is a process that died, and is ignored (and removed by a prune).
- **Last used.** Rewriting its lease also touches ``<group>/.used`` in each of its group
  folders, so a group's last use is the newest time of its files: a group that later fits
  only read from stays young.
- **Only ours.** A prune looks only at folders named as groups are (``<module>-<24 hex
  digits>``) and deletes only the files a store writes there (shards, their indices,
  temporary files, the ``.used`` mark), the indices first (a reader never finds half a
  shard), and the folder once empty: anything else in the folder is left alone.

Deleting a shard another process has mapped is safe on POSIX file systems: it keeps
reading the data until it lets go; it only loses the warm start of a later process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_speedkit import _validation

__all__ = ["Lease", "PruneReport", "folder_bytes", "prune_frozen_features"]

log = logging.getLogger(__name__)

LEASES = ".leases"
USED = ".used"
#: A lease not rewritten for this long belongs to a process that is gone.
LEASE_SECONDS = 3600.0
#: A running process rewrites its lease at most this often.
TOUCH_SECONDS = 60.0
_GROUP = re.compile(r".+-[0-9a-f]{24}")
_OURS = re.compile(r"([0-9a-f]{32}\.(json|bin))|(\.[0-9a-f]{32}\.(json|bin)\.tmp)|(\.used)")


class Lease:
    """This process's record of the group folders it uses (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LEASES / f"{uuid.uuid4().hex}.json"
        self.groups: set[str] = set()
        self._written = -float("inf")

    def use(self, folder: str) -> None:
        """Name ``folder`` (a group's) in the lease."""
        if folder not in self.groups:
            self.groups.add(folder)
            self.write()

    def forget(self, folders: Iterable[str]) -> None:
        """No longer name ``folders`` (features of weights gone by)."""
        gone = self.groups.intersection(folders)
        if gone:
            self.groups -= gone
            self.write()

    def touch(self) -> None:
        """Rewrite the lease if the last write is a minute old (cheap to call every step)."""
        if time.monotonic() - self._written >= TOUCH_SECONDS:
            self.write()

    def write(self) -> None:
        """The lease rewritten now, and each of its existing groups' ``.used`` touched."""
        self._written = time.monotonic()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_name(f".{self.path.name}.tmp")
            temporary.write_text(json.dumps(sorted(self.groups)))
            os.replace(temporary, self.path)
        except OSError as error:  # a read-only folder serves on; prune is advisory
            log.debug("FrozenFeatureCache could not write its lease %s: %s", self.path, error)
        _touch_used(self.directory, self.groups)

    def close(self) -> None:
        """The groups marked used now, the lease removed (:meth:`write` makes it again)."""
        _touch_used(self.directory, self.groups)
        try:
            self.path.unlink(missing_ok=True)
        except OSError as error:
            log.debug("FrozenFeatureCache could not remove its lease %s: %s", self.path, error)
        self._written = -float("inf")


def _touch_used(directory: Path, folders: Iterable[str]) -> None:
    for folder in folders:
        path = directory / folder
        if path.is_dir():
            try:
                (path / USED).touch()
            except OSError as error:
                log.debug("FrozenFeatureCache could not mark %s used: %s", path, error)


def _group_folders(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.iterdir() if p.is_dir() and _GROUP.fullmatch(p.name))
    except OSError:
        return []


def _ours(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if p.is_file() and _OURS.fullmatch(p.name)]
    except OSError:
        return []


def folder_bytes(directory: Path, skip: Iterable[str] = ()) -> int:
    """Bytes of shard data (``.bin`` files) in ``directory``'s group folders, those named in
    ``skip`` left out."""
    left_out, total = set(skip), 0
    for folder in _group_folders(directory):
        if folder.name not in left_out:
            for path in _ours(folder):
                if path.suffix == ".bin" and not path.name.startswith("."):
                    total += _stat(path)[0]
    return total


def _stat(path: Path) -> tuple[int, float]:
    try:
        stat = path.stat()
    except OSError:
        return 0, 0.0
    return stat.st_size, stat.st_mtime


def leased_groups(directory: Path, now: float, remove_dead: bool = False) -> set[str]:
    """The group folders named by a live lease (one rewritten within ``LEASE_SECONDS``)."""
    live: set[str] = set()
    try:
        leases = list((directory / LEASES).glob("*.json"))
    except OSError:
        return live
    for lease in leases:
        written = _stat(lease)[1]
        if now - written > LEASE_SECONDS:
            if remove_dead:
                with contextlib.suppress(OSError):
                    lease.unlink(missing_ok=True)
            continue
        try:
            live.update(str(name) for name in json.loads(lease.read_text()))
        except (OSError, ValueError, TypeError):  # unreadable: keep every group this time
            live.add("*")
    return live


@dataclass
class PruneReport:
    """What :func:`prune_frozen_features` removed (or, with ``dry_run``, would remove).

    Attributes:
        removed: the group folders removed, least recently used first.
        freed_bytes: their shard data, in bytes.
        kept_bytes: the shard data left in the folder, in bytes.
        in_use: the group folders kept because a running process uses them.
    """

    removed: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    kept_bytes: int = 0
    in_use: list[str] = field(default_factory=list)


def prune_frozen_features(
    directory: Any,
    *,
    older_than: float = 7 * 24 * 3600.0,
    max_bytes: int | None = None,
    keep: Iterable[str] = (),
    dry_run: bool = False,
) -> PruneReport:
    """Remove a disk store's groups of features that nobody uses any more.

    First every group not used for ``older_than`` seconds goes; then, with ``max_bytes``,
    the least recently used of the others until the folder's shard data is at most that.
    A group a running process uses (its lease, see the module docstring) or named in
    ``keep`` is never removed. Works without a Trainer, while other processes train.

    Args:
        directory: the folder given to ``FrozenFeatureCache(directory=...)``.
        older_than: seconds since a group's last use after which it goes (default a week;
            0: every group not in use).
        max_bytes: the most shard data to leave in the folder, or None for no limit.
        keep: group folder names to keep (``FrozenFeatures.disk_groups()``).
        dry_run: report what would go, remove nothing.

    Example::

        >>> import tempfile
        >>> report = prune_frozen_features(tempfile.mkdtemp(), older_than=0)
        >>> report.removed, report.freed_bytes
        ([], 0)
    """
    root = Path(os.fspath(_validation.path("directory", directory))).expanduser()
    if not root.is_dir():
        _validation.fail(
            "directory", str(root), "is not a folder", "pass the `directory` the cache was given"
        )
    older_than = _validation.non_negative_number("older_than", older_than)
    if max_bytes is not None:
        max_bytes = _validation.non_negative_int("max_bytes", max_bytes, example=2**30)
    now = time.time()
    live = leased_groups(root, now, remove_dead=not dry_run)
    kept = set(keep)
    groups = []  # (last use, shard bytes, folder)
    for folder in _group_folders(root):
        files = _ours(folder)
        data = sum(_stat(p)[0] for p in files if p.suffix == ".bin" and p.name[0] != ".")
        last = max([_stat(p)[1] for p in files] + [_stat(folder)[1]])
        groups.append((last, data, folder))
    groups.sort(key=lambda g: (g[0], g[2].name))
    report = PruneReport()
    total = sum(g[1] for g in groups)
    for last, data, folder in groups:
        if folder.name in kept:
            continue
        if "*" in live or folder.name in live:
            report.in_use.append(folder.name)
            continue
        if now - last < older_than and (max_bytes is None or total <= max_bytes):
            continue
        report.removed.append(folder.name)
        report.freed_bytes += data
        total -= data
        if not dry_run:
            _remove_group(folder)
    report.kept_bytes = total
    return report


def _remove_group(folder: Path) -> None:
    """Delete a group's files (indices first, so no reader takes half a shard), then the
    folder if nothing else is in it."""
    files = sorted(_ours(folder), key=lambda p: (p.suffix != ".json", p.name))
    for path in files:
        try:
            path.unlink(missing_ok=True)
        except OSError as error:
            log.debug("FrozenFeatureCache prune could not remove %s: %s", path, error)
    with contextlib.suppress(OSError):  # something else is in it, or a writer began a shard
        folder.rmdir()
