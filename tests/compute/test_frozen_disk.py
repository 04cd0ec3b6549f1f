"""The disk store of cache_frozen_features: shards that outlive the cache, and what goes wrong."""

from __future__ import annotations

import copy
import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from lightning_speedkit.compute import _frozen_disk
from lightning_speedkit.compute._frozen_core import FrozenFeatures, cache_frozen_features
from lightning_speedkit.compute._frozen_disk import DiskStore, check_directory
from lightning_speedkit.compute._frozen_loader import dataset_fingerprint
from lightning_speedkit.errors import SpeedkitConfigError

ROW = 6 * 4  # a sample's features: 6 float32, padded to 16 bytes
ROW_ON_DISK = 32


class _Tower(nn.Module):
    """A frozen encoder that counts the rows it ran on. Elementwise only: a row's output
    is the same bits whatever batch it runs in, so served rows compare bitwise."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.scale = nn.Parameter(torch.randn(6, generator=generator))
        self.bias = nn.Parameter(torch.randn(6, generator=generator))
        self.rows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return torch.relu(x.repeat(1, 2) * self.scale + self.bias)


def _model() -> nn.Sequential:
    return nn.Sequential(_Tower().requires_grad_(False), nn.Linear(6, 1))


def _data(n: int = 8, shift: float = 0.0) -> torch.Tensor:
    return torch.randn(n, 3, generator=torch.Generator().manual_seed(0)) + shift


def _epoch(cache: FrozenFeatures, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Two batches of four, the keys their row numbers; the tower's outputs in order."""
    out = []
    for start in (0, 4):
        with cache.keys(range(start, start + 4)):
            out.append(model[0](x[start : start + 4]))
    return torch.cat(out)


def _shards(folder: Path, suffix: str = ".json") -> list[Path]:
    return _stored(folder.rglob(f"*{suffix}"))


def _stored(paths: Any) -> list[Path]:
    """``paths`` without the leases (``.leases/``) and marks of use (``.used``)."""
    return sorted(p for p in paths if ".leases" not in p.parts and p.name != ".used")


def test_a_new_cache_on_the_same_weights_is_warm_from_disk_and_serves_bitwise(
    tmp_path: Path,
) -> None:
    x = _data()
    model = _model()
    first = cache_frozen_features(model, ["0"], directory=tmp_path, verify=False)
    computed = _epoch(first, model, x)
    first.remove()  # writes the buffered rows
    assert len(_shards(tmp_path)) == 1
    assert first.counts()["disk_bytes"] == 8 * ROW_ON_DISK
    assert first.counts()["store_bytes"] == 8 * ROW

    again = copy.deepcopy(model)  # another process: nothing shared but the folder
    again[0].rows.clear()
    cache = cache_frozen_features(again, ["0"], directory=tmp_path, budget=0, verify=False)
    served = _epoch(cache, again, x)
    served_again = _epoch(cache, again, x)
    # the first batch runs once, to learn the output's structure; the rest is served
    assert again[0].rows == [4]
    assert torch.equal(served, computed)
    assert torch.equal(served_again, computed)
    counts = cache.counts()
    assert (counts["hits"], counts["misses"], counts["stored"]) == (12, 4, 0)
    assert (counts["store_bytes"], counts["disk_bytes"]) == (0, 8 * ROW_ON_DISK)


def test_past_the_budget_features_are_served_from_disk(tmp_path: Path) -> None:
    x = _data()
    model = _model()
    cache = cache_frozen_features(model, ["0"], directory=tmp_path, budget=3 * ROW)
    computed = _epoch(cache, model, x)
    for _ in range(2):
        assert torch.equal(_epoch(cache, model, x), computed)
    # epoch 1 runs 8 and stores them (3 in memory, all 8 buffered for disk); epoch 2
    # verifies its first batch; the rest is served, in memory or from the buffer
    assert model[0].rows == [4, 4, 4]
    counts = cache.counts()
    assert (counts["hits"], counts["stored"], counts["not_stored"]) == (12, 8, 0)
    assert (counts["store_bytes"], counts["disk_bytes"]) == (3 * ROW, 0)  # nothing written yet
    cache.flush()
    assert cache.counts()["disk_bytes"] == 8 * ROW_ON_DISK
    assert torch.equal(_epoch(cache, model, x), computed)
    assert model[0].rows == [4, 4, 4]


def test_other_weights_or_another_dataset_never_get_the_stored_features(tmp_path: Path) -> None:
    x = _data()
    data = TensorDataset(x)
    model = _model()
    cache = cache_frozen_features(model, ["0"], directory=tmp_path, verify=False, dataset=data)
    _epoch(cache, model, x)
    cache.remove()
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed[0].bias.add_(1.0)
    other = cache_frozen_features(changed, ["0"], directory=tmp_path, verify=False, dataset=data)
    expected = torch.relu(x.repeat(1, 2) * changed[0].scale + changed[0].bias)
    assert torch.equal(_epoch(other, changed, x), expected)
    assert other.counts()["hits"] == 0
    other.remove()
    moved = TensorDataset(_data(shift=1.0))  # same length and type, other samples
    same = copy.deepcopy(model)
    third = cache_frozen_features(same, ["0"], directory=tmp_path, verify=False, dataset=moved)
    _epoch(third, same, x + 1.0)
    assert third.counts()["hits"] == 0
    third.remove()
    groups = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]  # not the leases
    assert len(groups) == 3  # a folder per weights and dataset


def test_a_full_disk_warns_once_stores_nothing_there_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(path: Path, data: Any) -> None:
        path.write_bytes(b"\0" * 3)  # a partial write, then the error
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_frozen_disk, "_write_file", full)
    x = _data()
    model = _model()
    cache = cache_frozen_features(model, ["0"], directory=tmp_path, budget=3 * ROW, verify=False)
    computed = _epoch(cache, model, x)
    with pytest.warns(UserWarning, match=r"stopped writing features.*the disk is full") as seen:
        cache.flush()
    assert len([w for w in seen if "stopped writing" in str(w.message)]) == 1
    assert _stored(tmp_path.rglob("*.*")) == []  # no shard, no temporary file left
    # the 5 samples past the budget were only in the failed shard: they run again, and
    # are not stored (memory is full, the disk takes nothing more); the 3 in memory serve
    for _ in range(2):
        assert torch.equal(_epoch(cache, model, x), computed)
    # samples 0-2 are in memory; sample 3 runs alone, beside a copy of itself (2 rows)
    assert model[0].rows == [4, 4, 2, 4, 2, 4]
    counts = cache.counts()
    assert (counts["hits"], counts["disk_bytes"], counts["store_bytes"]) == (6, 0, 3 * ROW)
    assert counts["not_stored"] == 10
    assert cache.store.disk is not None
    assert "No space left" in str(cache.store.disk.failed)


def test_a_crash_mid_write_leaves_nothing_that_is_read_as_a_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = _data()
    model = _model()
    fresh = copy.deepcopy(model)  # another process, later
    cache = cache_frozen_features(model, ["0"], directory=tmp_path, verify=False)
    _epoch(cache, model, x)
    replace = os.replace

    def crash_before_the_index(source: Any, target: Any) -> None:
        if str(target).endswith(".json"):
            raise KeyboardInterrupt  # the process dies between the data and its index
        replace(source, target)

    monkeypatch.setattr(os, "replace", crash_before_the_index)
    with pytest.raises(KeyboardInterrupt):
        cache.flush()
    monkeypatch.undo()
    (data,) = _shards(tmp_path, ".bin")  # the rows, complete, but without an index
    assert _shards(tmp_path) == []
    torn = data.with_name("torn.json")  # an index whose data file is short
    torn.write_text(data.with_suffix(".json").name)
    data.with_name("short.bin").write_bytes(data.read_bytes()[:40])
    index = json.dumps({"version": 1, "group": "?", "layout": [], "keys": [0]})
    data.with_name("short.json").write_text(index)
    later = cache_frozen_features(fresh, ["0"], directory=tmp_path, verify=False)
    _epoch(later, fresh, x)
    assert fresh[0].rows == [4, 4]
    assert later.counts()["hits"] == 0


def test_two_writers_share_a_folder_and_each_reads_the_others_shards(tmp_path: Path) -> None:
    base = ("tower", "weights", "call")
    rank0, rank1 = DiskStore(tmp_path), DiskStore(tmp_path)
    for key in range(4):
        assert rank0.put(base, key, (torch.full((6,), float(key)),))
        assert rank1.put(base, key + 4, (torch.full((6,), float(key + 4)),))
    rank0.flush()
    rank1.flush()
    assert rank0.get(base, 5) is None  # rank 1's shard is not looked for yet
    rank0.refresh()
    rank1.refresh()
    for store in (rank0, rank1):
        assert [store.get(base, k)[0][0].item() for k in range(8)] == list(range(8))  # type: ignore[index]
        assert store.bytes == 8 * ROW_ON_DISK
    assert len(_shards(tmp_path)) == 2
    assert len(_shards(tmp_path, ".bin")) == 2
    assert rank0.put(base, 5, (torch.zeros(6),))  # on disk already: not written again
    rank0.flush()
    assert len(_shards(tmp_path)) == 2


def test_features_that_prove_wrong_leave_the_disk(tmp_path: Path) -> None:
    model = _model()
    cache = cache_frozen_features(model, ["0"], directory=tmp_path, verify=False)
    _epoch(cache, model, _data())
    cache.remove()
    assert len(_shards(tmp_path)) == 1
    again = copy.deepcopy(model)
    checked = cache_frozen_features(again, ["0"], directory=tmp_path)  # verify=True
    with pytest.warns(UserWarning, match="recomputed features differ from the stored ones"):
        _epoch(checked, again, _data(shift=0.5))  # the same keys, other inputs
    assert checked.counts()["stood_down"]
    assert _shards(tmp_path) == []
    assert _shards(tmp_path, ".bin") == []


def test_keys_that_a_file_cannot_hold_stay_in_memory(tmp_path: Path) -> None:
    model = _model()
    cache = cache_frozen_features(model, ["0"], directory=tmp_path, verify=False)
    keys = [object() for _ in range(4)]
    with cache.keys(keys):
        model[0](_data(4))
    with cache.keys(keys):
        model[0](_data(4))
    cache.flush()
    assert cache.counts()["hits"] == 4
    assert _shards(tmp_path) == []


def test_a_directory_that_cannot_hold_shards_is_refused_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    afile = tmp_path / "features"
    afile.write_text("")
    with pytest.raises(SpeedkitConfigError, match=r"^`directory` is a file, got .*pass a folder"):
        cache_frozen_features(_model(), ["0"], directory=afile)
    with pytest.raises(SpeedkitConfigError, match=r"^`directory` is under a file \(.*features\)"):
        check_directory(afile / "cache")
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as for non-root
    with pytest.raises(SpeedkitConfigError, match=r"^`directory` cannot be written to"):
        check_directory(tmp_path / "new" / "cache")
    assert not (tmp_path / "new").exists()  # nothing created on the way


def test_a_full_buffer_is_written_as_a_shard_without_waiting_for_flush(tmp_path: Path) -> None:
    base = ("tower", "weights", "call")
    store = DiskStore(tmp_path, shard_bytes=2 * ROW_ON_DISK)
    for key in range(5):
        store.put(base, key, (torch.full((6,), float(key)),))
    assert len(_shards(tmp_path)) == 2  # rows 0-1 and 2-3; row 4 waits in the buffer
    assert store.bytes == 4 * ROW_ON_DISK
    assert store.get(base, 4)[0].tolist() == [4.0] * 6  # type: ignore[index]  # from the buffer
    later = DiskStore(tmp_path)
    assert later.get(base, 3)[0].tolist() == [3.0] * 6  # type: ignore[index]
    assert later.get(base, 4) is None


def test_the_dataset_fingerprint_sees_type_length_and_the_probed_samples_only() -> None:
    def data(values: torch.Tensor) -> str:
        return dataset_fingerprint(TensorDataset(values))

    values = torch.arange(10.0)
    assert data(values) == data(values.clone())
    assert data(values) != data(values[:9])  # another length
    assert data(values) != data(values.double())  # another dtype
    middle, other = values.clone(), values.clone()
    middle[5] = 99.0  # the first, middle and last samples are read
    other[3] = 99.0
    assert data(values) != data(middle)
    assert data(values) == data(other)  # the documented limit: a change elsewhere is unseen

    class Broken(TensorDataset):
        def __getitem__(self, index: int) -> Any:
            raise OSError("unreadable")

    assert dataset_fingerprint(Broken(values))  # never raises
