"""ProfilerSchedule's trace files: named, written gzip, capped in size, pruned.

Each window's chrome trace becomes ``<directory>/rank<R>-window<W>.pt.trace.json.gz``,
numbered on from the highest window already there (a second ``fit``, or another run
writing to the same directory, never overwrites earlier traces). A write that fails
leaves no partial file and raises :class:`TraceNotWrittenError` with the reason in the
user's terms (a vanished directory, a full disk); a trace over the size cap is deleted
before it is analysed; only the newest traces of this store are kept.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["Saved", "TraceNotWrittenError", "TraceStore"]


class TraceNotWrittenError(Exception):
    """A trace could not be written: ``what`` was tried, ``why`` it failed."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what} failed ({why})")
        self.what, self.why = what, why


class _NotWrittenError(Exception):
    """torch's profiler returned without writing the trace file."""


class Saved(NamedTuple):
    """A written trace: its path, its compressed size, whether it was kept (within the cap)."""

    path: Path
    size_mb: float
    kept: bool


def _why_not_written(directory: Path, error: BaseException | None, *, made: bool = True) -> str:
    """What a failed trace write means for the user: a vanished directory, a full disk.

    ``made``: whether the directory was made (at setup) and has changed since; before,
    the reason is what stands in the way of making it.
    """
    if directory.is_file():  # a file has its name
        if made:
            return f"the directory {directory} is now a file"
        return f"{directory} is a file, not a directory"
    if not directory.is_dir():
        if made:
            gone = "is no longer a directory" if directory.exists() else "no longer exists"
            return f"the directory {directory} {gone}"
        why = error.strerror if isinstance(error, OSError) and error.strerror else error
        return f"cannot make the directory {directory}: {why}"
    full = isinstance(error, OSError) and error.errno == errno.ENOSPC
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    if full or free == 0:
        left = "" if free is None else f", {free / 2**10:.0f} KiB free"
        return f"no space left on the device of {directory}{left}"
    if error is None:  # torch's profiler logs its own error and writes nothing
        return f"torch's profiler wrote no trace file in {directory} (its log above says why)"
    return f"{type(error).__name__}: {error}"


class TraceStore:
    """One rank's traces in one directory: the next name, the write, the cap, the pruning.

    Args:
        directory: where the traces go (:meth:`open` makes it and checks it first).
        rank: the process's global rank, in every name.
        max_trace_mb: a compressed trace larger than this is deleted unanalysed.
        keep: the newest traces of this store kept; older ones are deleted (traces
            already in the directory are left alone).

    Example::

        >>> import json, tempfile
        >>> from pathlib import Path
        >>> store = TraceStore(Path(tempfile.mkdtemp()), rank=0, max_trace_mb=1.0, keep=1)
        >>> export = lambda path: Path(path).write_text(json.dumps({"traceEvents": []}))
        >>> [store.save(export, lambda raw, path: None).path.name for _ in range(2)]
        ['rank0-window0.pt.trace.json.gz', 'rank0-window1.pt.trace.json.gz']
        >>> [p.name for p in store.directory.iterdir()]
        ['rank0-window1.pt.trace.json.gz']
    """

    def __init__(self, directory: Path, *, rank: int, max_trace_mb: float, keep: int) -> None:
        self.directory, self.rank = directory, rank
        self.max_trace_mb, self.keep = max_trace_mb, keep
        self.traces: list[Path] = []
        """The traces this store kept, oldest first (pruned ones removed)."""

    @classmethod
    def open(cls, directory: Path, *, rank: int, max_trace_mb: float, keep: int) -> TraceStore:
        """A store in ``directory``, made first, once this rank is seen to write there;
        raises :class:`TraceNotWrittenError` with the reason otherwise."""
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".write-test-rank{rank}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            why = _why_not_written(directory, error, made=False)
            raise TraceNotWrittenError(f"writing to {directory}", why) from error
        return cls(directory, rank=rank, max_trace_mb=max_trace_mb, keep=keep)

    def next_path(self) -> Path:
        """A name no earlier window in the directory has."""
        pattern = re.compile(rf"rank{self.rank}-window(\d+)\.pt\.trace\.json\.gz$")
        taken = [int(m.group(1)) for p in self.directory.iterdir() if (m := pattern.match(p.name))]
        index = max(taken, default=-1) + 1
        return self.directory / f"rank{self.rank}-window{index}.pt.trace.json.gz"

    def save(self, export: Callable[[str], Any], analyse: Callable[[Path, Path], None]) -> Saved:
        """Write a trace: ``export(raw)`` writes it as JSON, which is compressed to the
        next path; within the cap, ``analyse(raw, path)`` reads it before the JSON is
        removed, and the newest ``keep`` are kept. Raises :class:`TraceNotWrittenError`."""
        try:
            path = self.next_path()
        except OSError as error:
            why = _why_not_written(self.directory, error)
            raise TraceNotWrittenError("writing a trace", why) from error
        raw = path.with_suffix("")  # .pt.trace.json; torch writes <raw>.tmp, then renames it
        try:
            size_mb = self._compress(export, raw, path)
            # The cap first: analysing a trace takes about 13 bytes of memory per byte.
            if size_mb > self.max_trace_mb:
                path.unlink()
                return Saved(path, size_mb, kept=False)
            analyse(raw, path)
        finally:
            with contextlib.suppress(OSError):
                raw.unlink(missing_ok=True)
        self.traces.append(path)
        while len(self.traces) > self.keep:
            with contextlib.suppress(OSError):
                self.traces.pop(0).unlink(missing_ok=True)
        return Saved(path, size_mb, kept=True)

    def _compress(self, export: Callable[[str], Any], raw: Path, path: Path) -> float:
        """Export to ``raw``, gzip it to ``path``; its size in MB. A failure (a full disk
        must not stop training, nor stay full) leaves no partial file."""
        try:
            export(str(raw))
            if not raw.is_file():  # torch logged its own error and wrote nothing usable
                raise _NotWrittenError
            with raw.open("rb") as source, gzip.open(path, "wb", compresslevel=6) as target:
                shutil.copyfileobj(source, target)
            return path.stat().st_size / 2**20
        except Exception as error:
            cause = None if isinstance(error, _NotWrittenError) else error
            why = _why_not_written(self.directory, cause)
            for leftover in (raw, raw.with_name(raw.name + ".tmp"), path):
                with contextlib.suppress(OSError):
                    leftover.unlink(missing_ok=True)
            raise TraceNotWrittenError(f"writing the trace {path.name}", why) from error
