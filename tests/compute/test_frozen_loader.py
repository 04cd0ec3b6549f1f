"""key="index": the dataset index rides with each sample through any sampler, and leaves again."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_speedkit.compute._frozen_loader import (
    INDEX_FIELD,
    SampleIndex,
    batch_keys,
    with_sample_index,
)
from lightning_speedkit.data.bucketing import LengthBucketBatchSampler
from lightning_speedkit.errors import SpeedkitConfigError


class _Squares(Dataset[Any]):
    def __init__(self, n: int = 10, as_dict: bool = True) -> None:
        self.n, self.as_dict = n, as_dict

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        x = torch.tensor([float(i * i)])
        return {"x": x} if self.as_dict else (x, i)


def _indices_and_values(loader: DataLoader[Any]) -> list[tuple[list[Any], list[float]]]:
    seen = []
    for batch in with_sample_index(loader):
        keys = batch_keys(batch, "index")
        x = batch["x"] if isinstance(batch, dict) else batch[0]
        seen.append((keys, x.flatten().tolist()))
    return seen


@pytest.mark.parametrize(
    "make",
    [
        lambda ds: DataLoader(
            ds, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(1)
        ),
        lambda ds: DataLoader(
            ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=2, rank=1)
        ),
        lambda ds: DataLoader(
            ds, batch_sampler=LengthBucketBatchSampler([i % 4 for i in range(10)], 3)
        ),
        lambda ds: DataLoader(ds, batch_size=3, num_workers=1),
    ],
    ids=["shuffle", "distributed", "bucketing", "worker"],
)
def test_each_sample_carries_its_own_index(make: Any) -> None:
    loader = make(_Squares())
    seen = _indices_and_values(loader)
    assert seen
    for keys, values in seen:
        assert values == [float(k * k) for k in keys]
    everyone = sorted(k for keys, _ in seen for k in keys)
    assert everyone == sorted(i for batch in loader.batch_sampler for i in batch)


def test_the_order_is_the_users_and_the_index_field_leaves_the_batch() -> None:
    loader = DataLoader(
        _Squares(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3)
    )
    plain = [
        b["x"].flatten().tolist()
        for b in DataLoader(
            _Squares(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3)
        )
    ]
    indexed = with_sample_index(loader)
    assert indexed.batch_size == 4
    assert indexed.drop_last is False
    batches = list(indexed)
    assert [b["x"].flatten().tolist() for b in batches] == plain
    batch = batches[0]
    assert isinstance(batch[INDEX_FIELD], SampleIndex)
    batch_keys(batch, "index")
    assert list(batch) == ["x"]


def test_a_tuple_batch_becomes_a_list_with_the_index_last_then_taken_off() -> None:
    batch = next(iter(with_sample_index(DataLoader(_Squares(as_dict=False), batch_size=3))))
    assert isinstance(batch, list)
    assert len(batch) == 3
    assert batch_keys(batch, "index") == [0, 1, 2]
    assert len(batch) == 2
    assert batch[1].tolist() == [0, 1, 2]


def test_samples_the_collate_drops_take_their_index_with_them() -> None:
    class Holes(_Squares):
        def __getitem__(self, i: int) -> Any:
            return None if i % 3 == 1 else super().__getitem__(i)

    def collate(items: list[Any]) -> dict[str, torch.Tensor]:
        return {"x": torch.stack([item["x"] for item in items if item is not None])}

    batch = next(iter(with_sample_index(DataLoader(Holes(), batch_size=6, collate_fn=collate))))
    assert batch_keys(batch, "index") == [0, 2, 3, 5]
    assert batch["x"].flatten().tolist() == [0.0, 4.0, 9.0, 25.0]


def test_an_iterable_dataset_is_refused_with_the_field_fix() -> None:
    class Stream(IterableDataset[Any]):
        def __iter__(self) -> Any:
            yield {"x": torch.zeros(1)}

    with pytest.raises(
        SpeedkitConfigError, match=r"^`key` needs a map-style dataset.*`key='<field>'`"
    ):
        with_sample_index(DataLoader(Stream(), batch_size=2))


def test_a_loader_that_does_not_batch_is_refused_with_the_field_fix() -> None:
    """``batch_size=None``: the dataset's items are whole batches, one index for many
    rows; the index collate then failed in the loader with a bare TypeError."""
    data = [{"x": torch.zeros(4, 1)} for _ in range(3)]
    with pytest.raises(
        SpeedkitConfigError, match=r"^`key` needs a loader that batches samples.*`key='<field>'`"
    ):
        with_sample_index(DataLoader(data, batch_size=None))


def test_a_field_key_reads_the_field_and_a_missing_one_names_the_fields() -> None:
    assert batch_keys({"id": ["a", "b"], "x": torch.zeros(2)}, "id") == ["a", "b"]
    with pytest.raises(
        SpeedkitConfigError, match=r"^`key` is not a field of the batch \(its fields: 'x'\)"
    ):
        batch_keys({"x": torch.zeros(2)}, "id")
    with pytest.raises(SpeedkitConfigError, match=r"carries no dataset index"):
        batch_keys({"x": torch.zeros(2)}, "index")


def test_a_key_field_is_read_from_a_dataclass_or_namedtuple_batch_too() -> None:
    """``key='<field>'``: any batch with named fields, as SpeedMonitor reads them."""
    import collections
    import dataclasses

    from lightning_speedkit.compute._frozen_loader import batch_rows

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        uid: torch.Tensor

    Named = collections.namedtuple("Named", "x uid")
    ids = torch.tensor([4, 9])
    assert batch_rows(Batch(torch.zeros(2), ids), "uid") == ([4, 9], [])
    assert batch_rows(Named(torch.zeros(2), ids), "uid") == ([4, 9], [])
    with pytest.raises(SpeedkitConfigError, match="a list without fields"):
        batch_rows([torch.zeros(2), ids], "uid")
