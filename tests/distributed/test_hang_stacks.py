"""The stack dump: a file whole or not at all, stderr where it cannot be written."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lightning_speedkit import SpeedkitConfigError
from lightning_speedkit.distributed._hang_report import RankProgress
from lightning_speedkit.distributed._hang_stacks import (
    check_writable,
    dump_stacks,
    stacks_header,
    where_stacks_went,
)

WHERE = RankProgress(2, 5, 4, "backward", 3.25)


def header_from_another_thread() -> str:
    """As the watchdog's thread takes it: the main thread's stack is in the header."""
    out: list[str] = []
    thread = threading.Thread(target=lambda: out.append(stacks_header(2, 4, "why not", WHERE)))
    thread.start()
    thread.join()
    return out[0]


def test_the_header_says_where_and_why_then_every_thread() -> None:
    lines = header_from_another_thread().splitlines()
    assert lines[0].startswith("HangWatchdog stack dump: rank 2 of 4, host ")
    assert lines[1:5] == [
        "why: why not",
        "where: rank 2: batch 5 (global step 4), backward for 3.2 s",
        "",
        "--- Python stacks, every thread (most recent call last) ---",
    ]
    assert lines[6] == f"Thread MainThread (id {threading.main_thread().ident}):"  # first
    assert any("in header_from_another_thread" in line for line in lines)
    assert lines[-2:] == ["--- faulthandler (most recent call first) ---", ""]


def test_the_dump_is_written_whole(tmp_path: Path) -> None:
    path = dump_stacks(tmp_path / "dumps", 2, "the header\n")
    assert path == str(tmp_path / "dumps" / "hang-rank2.txt")
    text = Path(path).read_text()
    assert text.startswith("the header\n")
    assert "\nCurrent thread 0x" in text  # faulthandler's dump follows
    assert "(most recent call first)" in text
    assert "in test_the_dump_is_written_whole" in text
    assert [p.name for p in (tmp_path / "dumps").iterdir()] == ["hang-rank2.txt"]
    assert where_stacks_went(path) == f"stacks written to {path}"


def test_a_dump_that_cannot_be_written_goes_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "dumps").write_text("")  # a file where the directory was
    assert dump_stacks(tmp_path / "dumps", 2, "the header\n") is None
    err = capsys.readouterr().err
    assert err.startswith("the header\n")
    assert "(faulthandler's dump needs stderr to be a file: left out)" in err  # pytest's stderr
    (message,) = caplog.messages
    assert message.startswith(
        f"HangWatchdog: rank 2 could not write {tmp_path / 'dumps' / 'hang-rank2.txt'} ("
    )
    assert message.endswith("); stacks printed to stderr")
    assert where_stacks_went(None) == "stacks printed to stderr"


def test_check_writable(tmp_path: Path) -> None:
    check_writable(tmp_path / "made", 3, None)
    assert [p.name for p in (tmp_path / "made").iterdir()] == []  # the probe is gone
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SpeedkitConfigError, match=r"^`dirpath` must be a directory the stacks "
                       r"can be written to, got 'x/y': Not a directory; pass"):  # fmt: skip
        check_writable(tmp_path / "a-file" / "dumps", 0, "x/y")
