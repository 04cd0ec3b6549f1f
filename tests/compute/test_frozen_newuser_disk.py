"""The disk store's upkeep: what its byte counts mean, pruning, leases, the free-space reserve."""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path

import pytest
import torch

from lightning_speedkit.compute import _frozen_disk
from lightning_speedkit.compute._frozen_core import FrozenFeatures, cache_frozen_features
from lightning_speedkit.compute._frozen_lease import LEASES, prune_frozen_features
from lightning_speedkit.compute.frozen_feature_cache import FrozenFeatureCache
from lightning_speedkit.errors import SpeedkitConfigError

from .test_frozen_disk import ROW, ROW_ON_DISK, _data, _epoch, _model

DAY = 24 * 3600.0
EPOCH = 8 * ROW_ON_DISK  # one epoch of 8 samples, on disk


def _written(folder: Path, shift: float = 0.0) -> FrozenFeatures:
    """A cache whose tower's bias is moved by ``shift`` (other weights: another group), one
    epoch stored and written; still open (its lease names its group)."""
    model = _model()
    with torch.no_grad():
        model[0].bias.add_(shift)
    cache = cache_frozen_features(model, ["0"], directory=folder, verify=False)
    _epoch(cache, model, _data())
    cache.flush()
    return cache


def _age(folder: Path, seconds: float) -> None:
    """Make every file of group ``folder`` (and the folder) ``seconds`` old."""
    then = time.time() - seconds
    for path in [*folder.iterdir(), folder]:
        os.utime(path, (then, then))


def test_disk_bytes_count_the_current_weights_and_the_rest_is_reported_apart(
    tmp_path: Path,
) -> None:
    model = _model()
    cache = cache_frozen_features(model, ["0"], directory=tmp_path, verify=False)
    _epoch(cache, model, _data())
    cache.flush()
    assert (cache.counts()["disk_bytes"], cache.counts()["disk_other_bytes"]) == (EPOCH, 0)
    with torch.no_grad():
        model[0].bias.add_(1.0)  # the tower changed: its features so far are of old weights
    _epoch(cache, model, _data())
    cache.flush()
    counts = cache.counts()
    assert (counts["disk_bytes"], counts["disk_other_bytes"]) == (EPOCH, EPOCH)
    assert len(cache.disk_groups()) == 1
    assert counts["store_bytes"] == 8 * ROW  # memory holds the current weights' only


def test_prune_keeps_what_the_cache_serves_and_what_a_running_process_uses(
    tmp_path: Path,
) -> None:
    first = _written(tmp_path)
    (old,) = first.disk_groups()
    with torch.no_grad():
        first.model[0].bias.add_(1.0)
    _epoch(first, first.model, _data())
    first.flush()
    (current,) = first.disk_groups()
    other = _written(tmp_path, shift=2.0)  # another job on the same folder, still running
    (running,) = other.disk_groups()
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "pictures").mkdir()
    report = first.prune()
    assert (report.removed, report.in_use, report.freed_bytes) == ([old], [running], EPOCH)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == sorted(
        [current, running, "notes.txt", "pictures"]
    )
    assert first.counts()["disk_other_bytes"] == EPOCH  # the other job's
    other.remove()  # that job ends: its lease goes, its group is nobody's now
    assert list((tmp_path / LEASES).iterdir()) == [first.store.disk.lease.path]  # type: ignore[union-attr]
    report = FrozenFeatureCache.prune(tmp_path, older_than=0, keep=first.disk_groups())
    assert (report.removed, report.in_use, report.kept_bytes) == ([running], [], EPOCH)
    # the first cache serves as before, from memory and from its own shards
    assert torch.equal(_epoch(first, first.model, _data()), _epoch(first, first.model, _data()))


def test_prune_by_age_then_by_size_least_recently_used_first(tmp_path: Path) -> None:
    caches = [_written(tmp_path, shift=float(i)) for i in range(3)]
    names = [cache.disk_groups()[0] for cache in caches]
    for cache in caches:
        cache.remove()  # every job ended
    for name, age in zip(names, (10 * DAY, 3 * DAY, 3600.0), strict=True):
        _age(tmp_path / name, age)
    dry = prune_frozen_features(tmp_path, dry_run=True)
    assert (dry.removed, dry.freed_bytes, dry.kept_bytes) == ([names[0]], EPOCH, 2 * EPOCH)
    assert (tmp_path / names[0]).is_dir()  # a dry run removes nothing
    assert prune_frozen_features(tmp_path).removed == [names[0]]  # unused for a week
    assert not (tmp_path / names[0]).exists()
    report = prune_frozen_features(tmp_path, max_bytes=EPOCH)  # the least recently used goes
    assert (report.removed, report.kept_bytes) == ([names[1]], EPOCH)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [names[2]]


def test_a_group_read_by_a_later_fit_counts_as_used_then(tmp_path: Path) -> None:
    first = _written(tmp_path)
    first.remove()
    (name,) = first.disk_groups()
    _age(tmp_path / name, 30 * DAY)
    model = _model()
    again = cache_frozen_features(model, ["0"], directory=tmp_path, verify=False, budget=0)
    _epoch(again, model, _data())  # served from the old group
    again.remove()
    assert (again.counts()["hits"], model[0].rows) == (4, [4])
    assert prune_frozen_features(tmp_path).removed == []  # its last use is now


def test_a_dead_process_lease_keeps_nothing(tmp_path: Path) -> None:
    cache = _written(tmp_path)
    (name,) = cache.disk_groups()
    lease = cache.store.disk.lease.path  # type: ignore[union-attr]
    cache.remove()
    lease.parent.mkdir(exist_ok=True)
    lease.write_text(json.dumps([name]))  # as a process killed mid-fit leaves it
    assert prune_frozen_features(tmp_path, older_than=0).in_use == [name]
    then = time.time() - 2 * 3600.0
    os.utime(lease, (then, then))  # not rewritten for two hours: that process is gone
    assert prune_frozen_features(tmp_path, older_than=0).removed == [name]
    assert not lease.exists()


def test_a_shard_that_would_leave_the_disk_nearly_full_is_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(
        _frozen_disk.shutil, "disk_usage", lambda path: usage(2**33, 2**33 - 2**29, 2**29)
    )  # 512 MiB free of 8 GiB: the reserve is 5% (410 MiB); a shard of 64 bytes fits
    model = _model()
    cache = cache_frozen_features(model, ["0"], directory=tmp_path, verify=False)
    _epoch(cache, model, _data())
    cache.flush()
    assert cache.counts()["disk_bytes"] == EPOCH
    monkeypatch.setattr(
        _frozen_disk.shutil, "disk_usage", lambda path: usage(2**36, 2**36 - 2**30, 2**30)
    )  # 1 GiB free of 64 GiB: a shard would leave less than the reserve, 1 GiB
    with torch.no_grad():
        model[0].bias.add_(1.0)
    _epoch(cache, model, _data())
    with pytest.warns(
        UserWarning, match=r"stopped writing.*the disk is nearly full \(1024 MiB free"
    ):
        cache.flush()
    counts = cache.counts()
    assert (counts["disk_bytes"], counts["store_bytes"], counts["disk_other_bytes"]) == (
        0,
        8 * ROW,
        EPOCH,
    )
    assert torch.equal(_epoch(cache, model, _data()), _epoch(cache, model, _data()))  # served


def test_the_lease_names_the_groups_in_use_and_goes_when_the_cache_is_removed(
    tmp_path: Path,
) -> None:
    cache = _written(tmp_path)
    (lease,) = (tmp_path / LEASES).iterdir()
    assert json.loads(lease.read_text()) == cache.disk_groups()
    cache.remove()
    assert list((tmp_path / LEASES).iterdir()) == []
    cache.attach()  # a later fit of the same cache
    assert json.loads(lease.read_text()) == cache.disk_groups()


def test_prune_refuses_what_is_not_a_folder_and_a_cache_without_one(tmp_path: Path) -> None:
    with pytest.raises(SpeedkitConfigError, match=r"^`directory` is not a folder"):
        prune_frozen_features(tmp_path / "missing")
    with pytest.raises(SpeedkitConfigError, match=r"^`older_than`"):
        prune_frozen_features(tmp_path, older_than=-1)
    memory_only = cache_frozen_features(_model(), ["0"])
    with pytest.raises(SpeedkitConfigError, match=r"^`directory` is not set"):
        memory_only.prune()
