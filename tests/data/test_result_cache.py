"""The worker search's cache on disk: what is written is read back as cached, what
failures reached or a damaged file is not, and the fingerprint names what the result holds for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from lightning_speedkit.data._result_cache import (
    CACHE_VERSION,
    default_cache_dir,
    fingerprint,
    read_cache,
    write_cache,
)
from lightning_speedkit.data.tune_result import TuneResult

from ..helpers.models import SlowDataset

_BEST = {"num_workers": 2, "pin_memory": False, "persistent_workers": True, "prefetch_factor": 2}


def _result(skipped: str | None = None) -> TuneResult:
    table = [
        {"num_workers": 0, "batches_per_sec": 10.0, "skipped": None, "given": True},
        {**_BEST, "batches_per_sec": None if skipped else 24.0, "skipped": skipped,
         "given": False},
    ]  # fmt: skip
    return TuneResult(dict(_BEST), table, 24.0, 10.0, seconds=3.5)


def test_a_written_result_reads_back_as_cached(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "entry.json"
    write_cache(path, _result())
    assert not path.with_suffix(".tmp").exists()  # written whole, then moved into place
    back = read_cache(path)
    assert back == TuneResult(dict(_BEST), _result().table, 24.0, 10.0, seconds=0.0, cached=True)


def test_a_missing_damaged_or_failed_entry_is_not_read(tmp_path: Path) -> None:
    assert read_cache(tmp_path / "none.json") is None
    damaged = tmp_path / "damaged.json"
    damaged.write_text("{not json")
    assert read_cache(damaged) is None
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"best": {}, "unknown_field": 1}))
    assert read_cache(foreign) is None
    failed = tmp_path / "failed.json"
    write_cache(failed, _result(skipped="a worker crashed (RuntimeError: ...)"))
    assert failed.exists()
    assert read_cache(failed) is None  # a choice failures forced is measured again


def test_a_cache_that_cannot_be_written_is_said_and_nothing_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="could not write its cache at .*tuning will run again"):
        write_cache(blocker / "entry.json", _result())


def test_the_fingerprint_changes_with_what_the_result_holds_for() -> None:
    dataset = SlowDataset(n=64)
    same = fingerprint(DataLoader(dataset, batch_size=8), 1, 2)
    assert same == fingerprint(DataLoader(SlowDataset(n=64), batch_size=8), 1, 2)
    assert len(same) == 16
    assert int(same, 16) >= 0
    others = {
        fingerprint(DataLoader(dataset, batch_size=4), 1, 2),  # batching
        fingerprint(DataLoader(SlowDataset(n=32), batch_size=8), 1, 2),  # length
        fingerprint(DataLoader(dataset, batch_size=8), 2, 2),  # ranks on the machine
        fingerprint(DataLoader(dataset, batch_size=8), 1, 3),  # worker budget
    }
    assert same not in others
    assert len(others) == 4
    dataset.fingerprint = "captions-v2"  # type: ignore[attr-defined]
    assert fingerprint(DataLoader(dataset, batch_size=8), 1, 2) != same
    assert CACHE_VERSION == 3


def test_the_cache_lives_under_xdg_cache_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "lightning_speedkit" / "num_workers"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "lightning_speedkit" / "num_workers"
