"""Every thread's Python stacks, written where a hang leaves them: a file, or stderr.

A dump is a readable header (where the rank was, why it dumped, a traceback per thread,
the main thread first) followed by :mod:`faulthandler`'s raw dump of every thread. It
goes to ``hang-rank{R}.txt`` in the watchdog's directory, whole or not at all; where that
file cannot be written (the directory was checked at setup, but may go), to stderr: the
stacks are the one thing a hang leaves.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import logging
import os
import socket
import sys
import threading
import traceback
from pathlib import Path

from lightning_speedkit import _validation
from lightning_speedkit.distributed._hang_report import RankProgress
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["check_writable", "dump_stacks", "stacks_header", "where_stacks_went"]

log = logging.getLogger(__name__)


def check_writable(directory: Path, rank: int, dirpath: object) -> None:
    """Refuse, before training starts, a directory the stacks could not be written to:
    at a hang it is too late to ask for another. ``dirpath`` is what the user gave
    (None: the Trainer's ``default_root_dir``, which ``directory`` is then)."""
    error = _validation.write_error(directory, f".write-test-rank{rank}")
    if error is not None:
        shown = (repr(str(dirpath)) if dirpath is not None
                 else f"None (the Trainer's default_root_dir, {str(directory)!r})")  # fmt: skip
        raise SpeedkitConfigError(
            f"`dirpath` must be a directory the stacks can be written to, got {shown}: "
            f"{error.strerror or error}; pass `dirpath=` a writable directory, on a "
            f"cluster one every node shares."
        ) from error


def dump_stacks(directory: Path, rank: int, header: str) -> str | None:
    """``header`` and faulthandler's dump to ``directory/hang-rank{rank}.txt``; its path.

    Where the file cannot be written, the same on stderr, the error logged, and None.
    """
    path = directory / f"hang-rank{rank}.txt"
    try:
        write_stacks(path, header)
    except OSError as error:  # the stacks are what a hang leaves: never lose them
        log.error("HangWatchdog: rank %d could not write %s (%s); stacks printed to stderr",
                  rank, path, error)  # fmt: skip
        print_stacks(header)
        return None
    return str(path)


def where_stacks_went(path: str | None) -> str:
    """``stacks written to PATH``, or ``stacks printed to stderr`` (no path)."""
    return f"stacks written to {path}" if path is not None else "stacks printed to stderr"


def stacks_header(rank: int, world_size: int, why: str, progress: RankProgress) -> str:
    """Where the rank was and every thread's Python stack, readable (faulthandler's raw dump
    follows it). The calling thread's own stack is left to faulthandler's dump."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    lines = [
        f"HangWatchdog stack dump: rank {rank} of {world_size}, host {socket.gethostname()}, "
        f"pid {os.getpid()}, {datetime.datetime.now(datetime.timezone.utc).isoformat()}",
        f"why: {why}",
        f"where: {progress.describe()}",
        "",
        "--- Python stacks, every thread (most recent call last) ---",
    ]
    frames = sys._current_frames()
    frames.pop(threading.get_ident(), None)  # the watchdog's own: faulthandler shows it below
    main = threading.main_thread().ident
    for ident in sorted(frames, key=lambda i: i != main):  # the main thread first
        lines.append(f"\nThread {names.get(ident, '?')} (id {ident}):")
        lines.extend(line.rstrip("\n") for line in traceback.format_stack(frames[ident]))
    lines += ["", "--- faulthandler (most recent call first) ---", ""]
    return "\n".join(lines) + "\n"


def write_stacks(path: Path, header: str) -> None:
    """The header, then faulthandler's dump (C-level, all threads), to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    try:
        with partial.open("w", encoding="utf-8") as out:
            out.write(header)
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
        os.replace(partial, path)  # a reader never sees half a dump
    finally:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


def print_stacks(header: str) -> None:
    """The stacks that could not be written, on stderr (faulthandler's dump where stderr
    is a real file: it writes to a file descriptor)."""
    sys.stderr.write(header)
    sys.stderr.flush()
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no file descriptor (a captured stream)
        sys.stderr.write("(faulthandler's dump needs stderr to be a file: left out)\n")
