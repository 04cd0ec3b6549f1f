"""Output paths: refused before any work, naming the flag, the path and what to give."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lightning_speedkit.cli._output_paths import cannot_write, output_dir, output_file
from lightning_speedkit.cli._parser import CommandLineError


def _refusal(check: object, path: Path, flag: str) -> str:
    with pytest.raises(CommandLineError) as info:
        check(path, flag)  # type: ignore[operator]
    return str(info.value)


def test_a_directory_that_can_be_made_is_given_back_and_not_made(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    assert output_dir(str(target), "--out") == target
    assert not (tmp_path / "a").exists()  # checked, not created: the command creates it
    assert output_file(target / "rows.json", "--json") == target / "rows.json"


def test_a_file_where_a_directory_goes_and_a_directory_where_a_file_goes(
    tmp_path: Path,
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert _refusal(output_dir, afile, "--out") == (
        f"argument --out: {str(afile)!r} is a file, not a directory; give a directory"
    )
    assert _refusal(output_dir, afile / "runs", "--out") == (
        f"argument --out: cannot write {str(afile / 'runs')!r}: {str(afile)!r} is a file, "
        "not a directory; give a path under a directory"
    )
    assert _refusal(output_file, tmp_path, "--json") == (
        f"argument --json: {str(tmp_path)!r} is a directory; give a file name, e.g. "
        f"{str(tmp_path / 'results.json')!r}"
    )


def test_read_only_places_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    existing = tmp_path / "rows.json"
    existing.write_text("[]")
    refused = {str(locked), str(existing)}  # root may write anywhere: os.access decides
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **kw: str(p) not in refused and access(p, m))
    assert _refusal(output_dir, locked / "new", "--out") == (
        f"argument --out: cannot write {str(locked / 'new')!r}: {str(locked)!r} is not "
        "writable (permission denied or a read-only file system); give a writable directory"
    )
    assert _refusal(output_file, existing, "--json") == (
        f"argument --json: cannot overwrite {str(existing)!r}: read-only"
    )


def test_a_write_that_fails_after_the_checks_names_the_file_it_failed_on() -> None:
    full = OSError(28, "No space left on device", "/out/report.md")
    assert str(cannot_write("--out", Path("/out"), full)) == (
        "argument --out: cannot write '/out/report.md': No space left on device"
    )
    nameless = OSError("the disk went away")
    assert str(cannot_write("--out", Path("/out"), nameless)) == (
        "argument --out: cannot write '/out': the disk went away"
    )


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_place_permission_bits_allow_but_nothing_can_be_made_in_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """os.access says yes to root everywhere (here, to everyone): making it tells."""
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: True)
    target = Path("/proc/speedkit-probe/runs")
    for check, path in ((output_dir, target), (output_file, target / "rows.json")):
        refusal = _refusal(check, path, "--out")
        assert refusal.startswith(f"argument --out: cannot write {str(path)!r}: "), refusal
        assert refusal.endswith("; give a writable directory"), refusal
        assert len(refusal.splitlines()) == 1


def test_the_check_leaves_an_existing_directory_as_it_was(tmp_path: Path) -> None:
    (tmp_path / "kept.txt").write_text("x")
    assert output_dir(tmp_path, "--out") == tmp_path
    assert output_file(tmp_path / "new" / "rows.json", "--json") == tmp_path / "new" / "rows.json"
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"]  # no probe file, no new/
