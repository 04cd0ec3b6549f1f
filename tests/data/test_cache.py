"""SampleCache and the mixin's ``cache=``: the same samples, read from the dataset once."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import sys
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset, IterableDataset

from lightning_speedkit.data import SampleCache, SpeedDataModuleMixin
from lightning_speedkit.data.cache import sample_nbytes
from lightning_speedkit.errors import SpeedkitConfigError
from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule, VLMTask

from ..conftest import SMALL_CORPUS
from ..helpers.garbage import Collecting, uncollected_garbage


class Counting(Dataset[dict[str, torch.Tensor]]):
    """Deterministic samples of 16 float32 values (64 bytes), counting reads."""

    def __init__(self, n: int = 10) -> None:
        self.n = n
        self.reads = 0
        self.label = "counting"

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.reads += 1
        return {"x": torch.full((16,), float(i)), "y": torch.tensor(int(i))}


def _epoch(loader: torch.utils.data.DataLoader[Any]) -> list[torch.Tensor]:
    return [batch["x"] for batch in loader]


def test_samples_come_back_equal_and_are_read_once() -> None:
    data = Counting()
    cached = SampleCache(data)
    loader = torch.utils.data.DataLoader(cached, batch_size=3)
    plain = _epoch(torch.utils.data.DataLoader(Counting(), batch_size=3))
    first, second = _epoch(loader), _epoch(loader)
    for a, b, c in zip(plain, first, second, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a, c)
    assert data.reads == 10
    assert (cached.hits, cached.misses) == (10, 10)
    assert cached.nbytes == 10 * (16 * 4 + 8)


def test_max_bytes_bounds_what_is_kept() -> None:
    data = Counting()
    cached = SampleCache(data, max_bytes=3 * 72)  # room for three samples
    for _ in range(2):
        for i in range(10):
            assert int(cached[i]["y"]) == i
    assert cached.nbytes == 3 * 72
    assert data.reads == 10 + 7  # the seven that did not fit are read again
    cached.clear()
    assert cached.nbytes == 0
    cached[5]
    assert data.reads == 18


def test_pickling_for_spawned_workers_leaves_the_cache_behind() -> None:
    cached = SampleCache(Counting())
    for i in range(10):
        cached[i]
    copy = pickle.loads(pickle.dumps(cached))
    assert (copy.nbytes, copy.hits, copy.misses, len(copy._samples)) == (0, 0, 0, 0)
    assert int(copy[4]["y"]) == 4
    assert copy.label == "counting"  # the dataset's own attributes stay reachable


class Offset(Counting):
    """Counting samples shifted by ``offset``, which only a worker_init_fn sets."""

    offset = 0.0

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = super().__getitem__(i)
        return {"x": sample["x"] + self.offset, "y": sample["y"]}


def _set_offset(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    assert info is not None
    info.dataset.dataset.offset = 100.0  # type: ignore[attr-defined]


def test_warm_reads_every_sample_in_worker_processes() -> None:
    data = Counting(n=50)
    cached = SampleCache(data)
    assert cached.warm(num_workers=2, chunk_size=8, progress=False) == 50
    assert data.reads == 0  # read in the workers, not here
    assert (cached.warmed, cached.misses, cached.nbytes) == (50, 0, 50 * 72)
    for i in range(50):
        assert torch.equal(cached[i]["x"], Counting()[i]["x"])
        assert not cached[i]["x"].is_shared()  # kept by value, not as a shared segment
    assert (cached.hits, cached.misses, data.reads) == (100, 0, 0)
    assert cached.warm(num_workers=2, progress=False) == 0  # nothing left to read


def test_warm_reads_only_what_is_missing_and_stops_at_the_budget() -> None:
    data = Counting()
    cached = SampleCache(data, max_bytes=5 * 72)  # room for five samples
    cached[7], cached[2]
    assert cached.warm(num_workers=0, chunk_size=2, progress=False) == 3  # 0, 1, 3 kept
    assert data.reads == 2 + 4  # 4 was read and did not fit
    assert sorted(cached._samples) == [0, 1, 2, 3, 7]
    assert (cached.nbytes, cached.warmed) == (5 * 72, 3)
    cached[9]  # past the budget: read each time, as before
    assert data.reads == 7
    assert cached.warm(num_workers=2, progress=False) == 0  # stopped at the budget: no retry
    assert data.reads == 7


def test_samples_cross_from_the_workers_equal_and_by_value() -> None:
    from lightning_speedkit.data.cache import _pickled

    sample: dict[str, Any] = {
        "view": torch.arange(6.0).view(2, 3).t(),  # not contiguous
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),  # no numpy dtype
        "mask": torch.tensor([True, False]),
        "nested": [torch.tensor(3), b"raw", "text", None],
    }
    ((index, back),) = pickle.loads(_pickled([(4, sample)]))
    assert index == 4
    for key in ("view", "bf16", "mask"):
        assert torch.equal(back[key], sample[key])
        assert back[key].dtype == sample[key].dtype
    assert torch.equal(back["nested"][0], sample["nested"][0])
    assert back["nested"][1:] == [b"raw", "text", None]
    back["view"].add_(1)  # writable, and its own memory
    assert float(sample["view"][0, 0]) == 0.0


class Opening(Counting):
    """Counting samples that need ``open()`` in each worker first, as file-backed ones do."""

    opened = False

    def open(self) -> None:
        self.opened = True

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        assert self.opened, "read before open()"
        return super().__getitem__(i)


def _open_dataset(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    assert info is not None
    info.dataset.open()  # type: ignore[attr-defined]


def test_warm_leaves_torchs_random_state_as_it_was() -> None:
    torch.manual_seed(0)
    state = torch.get_rng_state()
    SampleCache(Counting(n=20)).warm(num_workers=2, chunk_size=4, progress=False)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_worker_init_fn_finds_the_datasets_own_methods() -> None:
    data = Opening(n=8)
    loader = torch.utils.data.DataLoader(SampleCache(data), batch_size=4, num_workers=1,
                                         worker_init_fn=_open_dataset)  # fmt: skip
    assert len(list(loader)) == 2  # what a loader over the cache does, warm does too
    cached = SampleCache(data)
    assert cached.warm(num_workers=1, progress=False, worker_init_fn=_open_dataset) == 8


def test_a_failing_read_ends_the_workers_and_keeps_what_was_read() -> None:
    class Broken(Counting):
        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            if i >= 12:
                raise ValueError(f"sample {i} is corrupt")
            return super().__getitem__(i)

    cached = SampleCache(Broken(n=20))
    with pytest.raises(ValueError, match="corrupt"):
        cached.warm(num_workers=1, chunk_size=4, progress=False)
    assert cached.warmed == len(cached._samples) > 0  # counted although it failed
    assert not multiprocessing.active_children()  # no worker outlives the error


def test_warm_runs_the_loaders_worker_init_fn() -> None:
    cached = SampleCache(Offset(n=6))
    cached.warm(num_workers=1, progress=False, worker_init_fn=_set_offset)
    assert [float(cached[i]["x"][0]) for i in range(6)] == [100.0 + i for i in range(6)]


def test_bad_input_is_refused_clearly() -> None:
    class Stream(IterableDataset[int]):
        def __iter__(self) -> Any:
            yield 1

    class SizedStream(Stream):  # webdataset-style: a length, and no index to cache by
        def __len__(self) -> int:
            return 1

    with pytest.raises(SpeedkitConfigError, match="map-style"):
        SampleCache(Stream())
    with pytest.raises(SpeedkitConfigError, match="map-style"):
        SampleCache(SizedStream())
    for bad in (-1, 1.5, True):
        with pytest.raises(SpeedkitConfigError, match="max_bytes"):
            SampleCache(Counting(), max_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(SpeedkitConfigError, match="num_workers"):
        SampleCache(Counting()).warm(num_workers=-1)
    with pytest.raises(SpeedkitConfigError, match="chunk_size"):
        SampleCache(Counting()).warm(chunk_size=0)
    with pytest.raises(SpeedkitConfigError, match="cache=True"):
        Data(cache=False).speed_dataloader(Counting(), batch_size=2, warm_cache=True)


def test_sample_nbytes_counts_nested_tensors_and_bytes() -> None:
    sample = {"a": torch.zeros(4, dtype=torch.float16), "b": [torch.zeros(2), b"abc"]}
    assert sample_nbytes(sample) == 8 + 8 + 3


def test_sample_nbytes_counts_what_tokenizers_and_image_datasets_return() -> None:
    """A tokenizer's lists of ids, a string, a PIL image: none of it is free."""
    ids = list(range(1000, 1100))
    assert sample_nbytes({"input_ids": ids}) == sum(sys.getsizeof(i) for i in ids)
    assert sample_nbytes("caption") == sys.getsizeof("caption")
    assert sample_nbytes((Image.new("RGB", (32, 16)), 3)) == 32 * 16 * 4 + sys.getsizeof(3)
    assert sample_nbytes(Image.new("L", (32, 16))) == 32 * 16
    cached = SampleCache(Tokens(), max_bytes=3 * sample_nbytes(Tokens()[0]))
    for _ in range(2):
        for i in range(10):
            cached[i]
    assert len(cached._samples) == 3  # the budget binds: before, lists counted 0 bytes


class Tokens(Dataset[dict[str, list[int]]]):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": [1000 + i] * 50}


@pytest.mark.parametrize(
    "indices",
    [
        torch.randperm(10),  # a permutation tensor as the sampler
        torch.where(torch.arange(10) % 2 == 0)[0],  # SubsetRandomSampler's usual indices
        np.arange(10),
    ],
    ids=["tensor", "subset", "numpy"],
)
def test_indices_of_any_integer_kind_find_their_sample(indices: Any) -> None:
    """A 0-d tensor hashes by identity: kept under itself, no read would ever hit."""
    data = Counting()
    cached = SampleCache(data)
    loader = torch.utils.data.DataLoader(cached, batch_size=2, sampler=indices)
    first, second = _epoch(loader), _epoch(loader)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert data.reads == len(indices)
    assert (cached.hits, len(cached._samples)) == (len(indices), len(indices))
    assert sorted(cached._samples) == sorted(int(i) for i in indices)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64,
                                   torch.bfloat16, torch.float8_e4m3fn])  # fmt: skip
def test_warm_sends_dtypes_that_torchs_own_pickling_fails_on(dtype: torch.dtype) -> None:
    """nanoGPT-style token ids in uint16: torch 2.13's pickling of them raises."""

    class Ids(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.arange(i, i + 6).to(dtype).reshape(2, 3)

    cached = SampleCache(Ids())
    assert cached.warm(num_workers=2, chunk_size=4, progress=False) == 8
    for i in range(8):
        sample = cached._samples[i]
        assert (sample.dtype, sample.shape) == (dtype, (2, 3))
        assert torch.equal(sample.float(), Ids()[i].float())


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_warm_sends_a_lazy_conjugate_or_negation(view: str) -> None:
    """``x.conj()`` is a view with the conjugate bit set, whose ``numpy()`` raises (and so
    did the warming worker's pickling); the sample arrives as its values."""

    class Complex(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> torch.Tensor:
            z = torch.tensor([1 + 2j, float(i) - 1j])
            return z.conj() if view == "conj" else torch.neg(z.conj()).conj()

    cached = SampleCache(Complex())
    assert cached.warm(num_workers=2, chunk_size=2, progress=False) == 4
    for i in range(4):
        assert torch.equal(cached._samples[i], Complex()[i])


class Data(SpeedDataModuleMixin, L.LightningDataModule):
    def __init__(self, cache: bool | int, warm: bool = False) -> None:
        super().__init__()
        self.data = Counting()
        self.cache = cache
        self.warm = warm

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        return self.speed_dataloader(self.data, batch_size=4, shuffle=True, cache=self.cache,
                                     warm_cache=self.warm)  # fmt: skip


def test_the_mixin_keeps_one_cache_across_reloaded_loaders() -> None:
    dm = Data(cache=True)
    first, second = dm.train_dataloader(), dm.train_dataloader()
    assert isinstance(first.dataset, SampleCache)
    assert first.dataset is second.dataset
    _epoch(first)
    _epoch(second)
    assert dm.data.reads == 10
    # shuffled epochs see every sample once each, whatever the order
    firsts = torch.cat(_epoch(dm.train_dataloader()))[:, 0]
    assert sorted(firsts.tolist()) == [float(i) for i in range(10)]


class Curriculum(Data):
    """A new dataset at every reload, as a curriculum makes."""

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        self.data = Counting()
        return super().train_dataloader()


def test_the_mixin_lets_a_replaced_datasets_cache_go() -> None:
    dm = Curriculum(cache=True)
    loaders = [dm.train_dataloader() for _ in range(3)]
    caches = [weakref.ref(loader.dataset) for loader in loaders]
    for loader in loaders:
        _epoch(loader)
    del loaders, loader
    gc.collect()
    # the hook's latest cache stays for its next reload; the older ones went with their
    # loaders (before, every reload's cache was kept for the DataModule's life)
    assert [cache() is not None for cache in caches] == [False, False, True]
    copy = pickle.loads(pickle.dumps(dm))  # as ddp_spawn sends it: the caches stay behind
    assert copy.__dict__["_speed_sample_caches"].latest == {}
    assert isinstance(copy.speed_dataloader(dm.data, batch_size=4, cache=True).dataset,
                      SampleCache)  # fmt: skip


def test_the_mixin_warms_the_cache_once_before_the_first_batch() -> None:
    dm = Data(cache=True, warm=True)
    loader = dm.train_dataloader()
    cache = loader.dataset
    assert isinstance(cache, SampleCache)
    assert (cache.warmed, len(cache._samples)) == (10, 10)
    _epoch(loader)
    _epoch(dm.train_dataloader())  # a reloaded loader finds it warm: nothing read again
    assert (cache.warmed, cache.misses, cache.hits) == (10, 0, 20)


def test_the_mixin_keeps_the_shuffled_order_when_it_warms() -> None:
    orders = []
    for warm in (False, True):
        torch.manual_seed(0)
        dm = Data(cache=True, warm=warm)
        orders.append(torch.cat([b["y"] for b in dm.train_dataloader()]).tolist())
    assert orders[0] == orders[1]


def test_the_mixin_skips_warming_for_spawned_workers() -> None:
    dm = Data(cache=True, warm=True)
    with pytest.warns(UserWarning, match="start by 'spawn', which gives each an empty cache"):
        loader = dm.speed_dataloader(dm.data, batch_size=4, cache=True, warm_cache=True,
                                     num_workers=1, multiprocessing_context="spawn")  # fmt: skip
    assert isinstance(loader.dataset, SampleCache)
    assert loader.dataset.warmed == 0
    forked = dm.speed_dataloader(dm.data, batch_size=4, cache=True, warm_cache=True,
                                 num_workers=1, multiprocessing_context="fork")  # fmt: skip
    assert isinstance(forked.dataset, SampleCache)
    assert forked.dataset.warmed == 10  # forked workers inherit the warm cache


def test_the_mixin_without_cache_reads_every_time() -> None:
    dm = Data(cache=False)
    loader = dm.train_dataloader()
    assert not isinstance(loader.dataset, SampleCache)
    _epoch(loader)
    _epoch(loader)
    assert dm.data.reads == 20


class CachedVLMData(SpeedDataModuleMixin, VLMDataModule):
    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        dataset = self.datasets["train"]
        return self.speed_dataloader(
            dataset, batch_size=self.batch_size, sampler=self.shuffle_sampler(dataset),
            drop_last=True, collate_fn=self.collate, cache=True,
        )  # fmt: skip


class WarmedVLMData(SpeedDataModuleMixin, VLMDataModule):
    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        dataset = self.datasets["train"]
        return self.speed_dataloader(
            dataset, batch_size=self.batch_size, sampler=self.shuffle_sampler(dataset),
            drop_last=True, collate_fn=self.collate, cache=True, warm_cache=True,
        )  # fmt: skip


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(data_class: type[VLMDataModule], data_dir: Path) -> tuple[list[float], VLMDataModule]:
    L.seed_everything(0, verbose=False)
    tokenizer = CaptionTokenizer()
    config = VLMConfig.preset("tiny", tokenizer.vocab_size)
    data = data_class(data_dir, batch_size=8, corpus=SMALL_CORPUS, progress=False)
    losses = Losses()
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, limit_val_batches=0, logger=False,
                        callbacks=[losses], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(VLMTask(config, pad_id=tokenizer.pad_id), datamodule=data)
    return losses.losses, data


def test_training_on_cached_samples_follows_the_same_trajectory(small_corpus: Path) -> None:
    plain, _ = _fit(VLMDataModule, small_corpus)
    cached, data = _fit(CachedVLMData, small_corpus)
    assert len(plain) == 2 * SMALL_CORPUS.train_samples // 8
    assert cached == plain  # bitwise: the same samples in the same order
    (cache,) = data.__dict__["_speed_sample_caches"].latest.values()
    assert (cache.misses, cache.hits) == (SMALL_CORPUS.train_samples,) * 2
    # decoded ahead in worker processes: every epoch from the cache, the same trajectory
    warmed, data = _fit(WarmedVLMData, small_corpus)
    assert warmed == plain
    (cache,) = data.__dict__["_speed_sample_caches"].latest.values()
    assert (cache.warmed, cache.misses) == (SMALL_CORPUS.train_samples, 0)
    assert cache.hits == 2 * SMALL_CORPUS.train_samples


def test_warm_workers_never_finalize_this_processs_garbage(tmp_path: Path) -> None:
    """A gloo process group left in a cycle hung a forked worker that collected it."""
    log = tmp_path / "finalized_in"
    with uncollected_garbage(log):
        cached = SampleCache(Collecting())
        assert cached.warm(num_workers=2, chunk_size=5, progress=False) == 10
        assert not log.exists()  # neither worker finalized it
    gc.collect()
    assert log.read_text().split() == [str(os.getpid())]  # this process did, once
    assert gc.get_freeze_count() == 0  # every object back with this process's collector


def test_warm_leaves_a_programs_own_frozen_objects_frozen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It collects the garbage here, before the fork, instead of freezing and unfreezing.

    (Its calls are recorded rather than the frozen count compared: a frozen object freed
    by its reference count leaves the count, so the count moves by itself.)
    """
    log = tmp_path / "finalized_in"
    unfreeze = gc.unfreeze
    gc.freeze()
    calls: list[str] = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
    try:
        with uncollected_garbage(log):
            cached = SampleCache(Collecting())
            assert cached.warm(num_workers=1, progress=False) == 10
        assert calls == []
        assert gc.get_freeze_count() > 0
        assert log.read_text().split() == [str(os.getpid())]  # finalized here, not in a worker
    finally:
        unfreeze()


def test_an_index_of_one_element_but_not_0_d_is_not_taken_for_that_int() -> None:
    """`tensor([3])` fetches a batch of one from a tensor dataset: not sample 3."""
    data = torch.utils.data.TensorDataset(torch.arange(10) * 10)
    cached = SampleCache(data)
    (batched,) = cached[torch.tensor([3])]
    assert batched.shape == (1,)
    (single,) = cached[3]
    assert single.shape == ()
    assert int(single) == 30
    assert list(cached._samples) == [3]
