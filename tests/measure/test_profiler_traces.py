"""TraceStore: names, the gzip write, the size cap and the pruning, with a fake export."""

from __future__ import annotations

import errno
import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from lightning_speedkit.measure._profiler_traces import TraceNotWrittenError, TraceStore

TRACE = {"traceEvents": [{"name": "ProfilerStep#1", "ph": "X", "ts": 0, "dur": 5}]}


def export(path: str) -> None:
    Path(path).write_text(json.dumps(TRACE))


def test_a_trace_is_compressed_analysed_from_its_json_and_the_json_removed(
    tmp_path: Path,
) -> None:
    store = TraceStore(tmp_path, rank=2, max_trace_mb=1.0, keep=5)
    seen: list[tuple[str, str, Any]] = []

    def analyse(raw: Path, path: Path) -> None:
        seen.append((raw.name, path.name, json.loads(raw.read_text())))

    saved = store.save(export, analyse)
    assert saved.path == tmp_path / "rank2-window0.pt.trace.json.gz"
    assert saved.kept
    assert saved.size_mb == saved.path.stat().st_size / 2**20
    assert seen == [("rank2-window0.pt.trace.json", "rank2-window0.pt.trace.json.gz", TRACE)]
    with gzip.open(saved.path) as handle:
        assert json.load(handle) == TRACE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank2-window0.pt.trace.json.gz"]


def test_names_go_on_from_the_highest_window_of_this_rank(tmp_path: Path) -> None:
    for name in ("rank0-window4.pt.trace.json.gz", "rank1-window9.pt.trace.json.gz"):
        (tmp_path / name).write_bytes(b"")
    store = TraceStore(tmp_path, rank=0, max_trace_mb=1.0, keep=5)
    assert store.next_path().name == "rank0-window5.pt.trace.json.gz"


def test_only_the_newest_of_this_store_are_kept(tmp_path: Path) -> None:
    earlier = tmp_path / "rank0-window0.pt.trace.json.gz"
    earlier.write_bytes(b"an earlier run's")
    store = TraceStore(tmp_path, rank=0, max_trace_mb=1.0, keep=2)
    for _ in range(4):
        store.save(export, lambda raw, path: None)
    assert [p.name for p in store.traces] == ["rank0-window3.pt.trace.json.gz",
                                              "rank0-window4.pt.trace.json.gz"]  # fmt: skip
    assert sorted(tmp_path.iterdir()) == [earlier, *store.traces]


def test_a_trace_over_the_cap_is_deleted_unanalysed(tmp_path: Path) -> None:
    store = TraceStore(tmp_path, rank=0, max_trace_mb=1e-6, keep=2)
    analysed: list[Path] = []
    saved = store.save(export, lambda raw, path: analysed.append(raw))
    assert not saved.kept
    assert saved.size_mb > 1e-6
    assert analysed == []
    assert store.traces == []
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_leaves_no_partial_file_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gzip, "open", full_disk)
    store = TraceStore(tmp_path, rank=0, max_trace_mb=1.0, keep=2)
    with pytest.raises(TraceNotWrittenError) as failure:
        store.save(export, lambda raw, path: None)
    assert failure.value.what == "writing the trace rank0-window0.pt.trace.json.gz"
    assert failure.value.why.startswith(f"no space left on the device of {tmp_path}")
    assert list(tmp_path.iterdir()) == []


def test_an_export_that_writes_nothing_is_torchs_own_error(tmp_path: Path) -> None:
    store = TraceStore(tmp_path, rank=0, max_trace_mb=1.0, keep=2)
    with pytest.raises(TraceNotWrittenError) as failure:
        store.save(lambda path: None, lambda raw, path: None)
    assert failure.value.why == (
        f"torch's profiler wrote no trace file in {tmp_path} (its log above says why)"
    )


def test_a_vanished_directory_is_named(tmp_path: Path) -> None:
    store = TraceStore(tmp_path / "gone", rank=0, max_trace_mb=1.0, keep=2)
    with pytest.raises(TraceNotWrittenError) as failure:
        store.save(export, lambda raw, path: None)
    assert (failure.value.what, failure.value.why) == (
        "writing a trace", f"the directory {tmp_path / 'gone'} no longer exists")  # fmt: skip


def test_open_makes_the_directory_or_says_why_it_cannot(tmp_path: Path) -> None:
    store = TraceStore.open(tmp_path / "a" / "b", rank=3, max_trace_mb=1.0, keep=1)
    assert store.directory.is_dir()
    assert list(store.directory.iterdir()) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(TraceNotWrittenError) as failure:
        TraceStore.open(tmp_path / "file", rank=0, max_trace_mb=1.0, keep=1)
    file = tmp_path / "file"
    assert (failure.value.what, failure.value.why) == (
        f"writing to {file}", f"{file} is a file, not a directory")  # fmt: skip
