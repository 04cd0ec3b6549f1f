"""Output paths checked before any long work, and a write that fails after them, as one line.

A subcommand checks where it will write before it trains or times anything, so a bad
``--out`` costs a second, not the whole run; each refusal names the flag, the path and
what to give instead. The check makes the directory and a file in it, and removes what
it made: permission bits alone say yes to root where nothing can be written.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from lightning_speedkit.cli._parser import CommandLineError


def output_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """``path``, a directory the command can create or write in: checked before the work."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise CommandLineError(
            f"argument {flag}: {str(target)!r} is a file, not a directory; give a directory"
        )
    _check_writable_under(target, target, flag)
    return target


def output_file(path: str | os.PathLike[str], flag: str) -> Path:
    """``path``, a file the command can create or overwrite: checked before the work."""
    target = Path(path)
    if target.is_dir():
        raise CommandLineError(
            f"argument {flag}: {str(target)!r} is a directory; give a file name, e.g. "
            f"{str(target / 'results.json')!r}"
        )
    if target.exists() and not os.access(target, os.W_OK):
        raise CommandLineError(f"argument {flag}: cannot overwrite {str(target)!r}: read-only")
    _check_writable_under(target, target.parent, flag)
    return target


def _check_writable_under(target: Path, directory: Path, flag: str) -> None:
    """``directory`` (where ``target`` goes) exists and is writable, or can be created."""
    existing = directory
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise CommandLineError(
            f"argument {flag}: cannot write {str(target)!r}: {str(existing)!r} is a file, "
            "not a directory; give a path under a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CommandLineError(
            f"argument {flag}: cannot write {str(target)!r}: {str(existing)!r} is not writable "
            "(permission denied or a read-only file system); give a writable directory"
        )
    _try_writing(target, directory, flag)


def _try_writing(target: Path, directory: Path, flag: str) -> None:
    """Make ``directory`` and a file in it, then remove what was made.

    ``os.access`` says yes to root everywhere, also where nothing can be made (under
    ``/proc``): only trying tells.
    """
    missing = [p for p in (directory, *directory.parents) if not p.exists()]  # deepest first
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise CommandLineError(
            f"argument {flag}: cannot write {str(target)!r}: {exc.strerror or exc}; "
            "give a writable directory"
        ) from exc
    finally:
        for made in missing:
            with contextlib.suppress(OSError):
                made.rmdir()


def cannot_write(flag: str, path: Path, error: OSError) -> CommandLineError:
    """An output that failed to write after the checks (disk full, a race): one line."""
    where = error.filename or path
    return CommandLineError(
        f"argument {flag}: cannot write {str(where)!r}: {error.strerror or error}"
    )
