"""The worker search's cache on disk: what is written is read back as cached, what
failures reached or a damaged file is not, and the fingerprint names what the result holds for."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

from lightning_speedkit.data._result_cache import (
    _ITEMS,
    CACHE_VERSION,
    default_cache_dir,
    fingerprint,
    read_cache,
    write_cache,
)
from lightning_speedkit.data.tune_result import TuneResult

from ..helpers.models import SlowDataset
from ..helpers.multiprocess import REPO, clean_env

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


class Images(Dataset[torch.Tensor]):
    """512 samples through ``transform``: what a sample costs is the transform's."""

    def __init__(self, transform: Any) -> None:
        self.transform = transform

    def __len__(self) -> int:
        return 512

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.transform(torch.full((8,), float(i)))


class Photos(Images):
    """Another class, read the same way."""


def cheap(x: torch.Tensor) -> torch.Tensor:
    return x


def heavy(x: torch.Tensor) -> torch.Tensor:
    time.sleep(0.004)  # a decode
    return x


def _stack(batch: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(batch)


def _init(worker_id: int) -> None:
    torch.manual_seed(worker_id)


def _get_slow(self: Any, i: int) -> torch.Tensor:
    time.sleep(0.004)
    return torch.full((8,), float(i))


def _get_fast(self: Any, i: int) -> torch.Tensor:
    return torch.full((8,), float(i))


def _same_name(getitem: Any) -> type:
    """A class named ``Images`` like the one above, whose ``__getitem__`` is ``getitem``."""
    return type("Images", (Images,), {"__getitem__": getitem, "__module__": __name__})


def _key(dataset: Dataset[Any], **kwargs: Any) -> str:
    return fingerprint(DataLoader(dataset, **{"batch_size": 8, **kwargs}), 1, 2)


def test_loaders_that_differ_in_what_loading_costs_have_their_own_entries() -> None:
    """Two Subsets of 256 samples of one class, a cheap and a 4 ms transform, shared one
    entry (class name, length, batch size, collate name): the heavy one got the cheap
    one's num_workers=0, 'cached' at 32,246 batches/s where it made 57."""
    base = _key(Subset(Images(cheap), range(256)), shuffle=True)
    assert base == _key(Subset(Images(cheap), range(256)), shuffle=True)  # new objects alike
    others = {
        "transform": _key(Subset(Images(heavy), range(256)), shuffle=True),
        "indices": _key(Subset(Images(cheap), range(256, 512)), shuffle=True),
        "index list": _key(Subset(Images(cheap), list(range(1, 257))), shuffle=True),
        "wrapped class": _key(Subset(Photos(cheap), range(256)), shuffle=True),
        "getitem code": _key(Subset(_same_name(_get_slow)(cheap), range(256)), shuffle=True),
        "sampler": _key(Subset(Images(cheap), range(256))),
        "collate": _key(Subset(Images(cheap), range(256)), shuffle=True, collate_fn=_stack),
        "init": _key(Subset(Images(cheap), range(256)), shuffle=True, worker_init_fn=_init),
        "pin": _key(Subset(Images(cheap), range(256)), shuffle=True, pin_memory=True),
        "workers": _key(Subset(Images(cheap), range(256)), shuffle=True, num_workers=2),
        "prefetch": _key(Subset(Images(cheap), range(256)), shuffle=True, num_workers=2,
                         prefetch_factor=4),
        "context": _key(Subset(Images(cheap), range(256)), shuffle=True, num_workers=2,
                        multiprocessing_context="spawn"),
        "partial": _key(Subset(Images(functools.partial(torch.clamp, min=0)), range(256)),
                        shuffle=True),
        "lambda": _key(Subset(Images(lambda x: x * 2), range(256)), shuffle=True),
    }  # fmt: skip
    assert base not in others.values()
    assert len(set(others.values())) == len(others)
    assert (
        _key(Subset(_same_name(_get_fast)(cheap), range(256)), shuffle=True)
        != others["getitem code"]
    )
    parts = [Subset(Images(cheap), range(256)), Subset(Images(cheap), range(256, 512))]
    mixed = [Subset(Images(cheap), range(256)), Subset(Images(heavy), range(256, 512))]
    assert _key(ConcatDataset(parts)) != _key(ConcatDataset(mixed))


class Tagged(Images):
    """Attributes whose order in memory differs from run to run (a set of strings, a
    constant set in code) and a closure: the key must not."""

    def __init__(self) -> None:
        size = 224
        super().__init__(lambda x: x * size if str(x.dtype) in {"float", "half", "int"} else x)
        self.fields = {"image", "caption", "label", "id"}


def stable_key() -> str:
    """The key of a loader over :class:`Tagged` (a subprocess prints it)."""
    return _key(Subset(Tagged(), [5, 3, 1]), shuffle=True, collate_fn=_stack)


def test_the_key_is_the_same_from_one_run_to_the_next() -> None:
    """A cross-run cache: interpreters that hash strings with other seeds and hold objects
    at other addresses compute the same key. Fresh ones: a test process that ran other
    tests first may differ in what the key rightly holds (its cores)."""
    code = "from tests.data.test_result_cache import stable_key; print(stable_key())"
    keys = set()
    for hash_seed in ("0", "1"):
        env = {**clean_env(), "PYTHONHASHSEED": hash_seed}
        run = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
        keys.add(run.stdout.strip())
    assert len(keys) == 1


class _Group(Mapping[str, int]):
    """A lazy on-disk group (h5py, zarr): each item ``items()`` gives is one opened."""

    def __init__(self, size: int) -> None:
        self.size, self.opened = size, 0

    def __getitem__(self, key: str) -> int:
        self.opened += 1
        return int(key)

    def __iter__(self) -> Iterator[str]:
        return (str(i) for i in range(self.size))

    def __len__(self) -> int:
        return self.size


class _Shards(Dataset[int]):
    def __init__(self, group: _Group) -> None:
        self.group = group

    def __getitem__(self, index: int) -> int:
        return self.group[str(index)]

    def __len__(self) -> int:
        return len(self.group)


def test_a_mapping_is_read_for_its_first_items_only() -> None:
    """The key listed every item of a mapping, then kept the first 64: a group of 10,000
    members on disk was opened whole to name the cache entry."""
    group = _Group(10_000)
    fingerprint(DataLoader(_Shards(group)), 1, 2)
    assert group.opened == _ITEMS == 64
