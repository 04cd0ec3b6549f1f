"""What SpeedMonitor reads of a batch, on its own: samples, tokens, signature."""

from __future__ import annotations

import collections
import dataclasses
import warnings

import pytest
import torch

from lightning_speedkit import SpeedkitConfigError
from lightning_speedkit.measure import _batch_info
from lightning_speedkit.measure._batch_info import BatchReader, number


def test_loaders_of_a_step_add_up_their_samples_and_tokens() -> None:
    text = {"input_ids": torch.zeros(4, 16, dtype=torch.long)}
    images = (torch.zeros(6, 3, 8, 8), torch.zeros(6, dtype=torch.long))
    info = BatchReader().read({"a": text, "b": images}, [text, images])
    assert (info.samples, info.tokens) == (10, 64)  # images hold no 2-D integer tensor
    assert info.signature == (
        ((4, 16), "torch.int64"),
        ((6, 3, 8, 8), "torch.float32"),
        ((6,), "torch.int64"),
    )


def test_the_users_functions_replace_the_defaults() -> None:
    batch = {"input_ids": torch.zeros(4, 16, dtype=torch.long)}
    reader = BatchReader(samples_per_batch=lambda b: 3, tokens_per_batch=lambda b: 50)
    info = reader.read(batch, [batch])
    assert (info.samples, info.tokens) == (3, 50)


def test_a_batch_without_tensors_counts_one_sample_and_says_so_once() -> None:
    reader = BatchReader()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = [reader.read(b, [b]).samples for b in ({"ids": [1, 2]}, torch.tensor(3.0))]
    assert counts == [1, 1]
    messages = [str(w.message) for w in caught if "cannot tell how many samples" in str(w.message)]
    assert len(messages) == 1
    assert "samples_per_batch=lambda batch" in messages[0]


class OwnBatch:
    """A batch object of one's own: tensors as attributes, its size as its length."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __len__(self) -> int:
        return int(self.x.shape[0])


def test_a_batch_object_of_ones_own_counts_its_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """It counted one sample a batch (samples/s 16x too low), said to hold no tensor. A
    length need not be a sample count: which one is used is said, once."""
    said: list[str] = []
    monkeypatch.setattr(_batch_info, "rank_zero_info", said.append)
    reader, batch = BatchReader(), OwnBatch(torch.zeros(16, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning
        assert [reader.read(batch, [batch]).samples for _ in range(2)] == [16, 16]
    assert said == [
        "SpeedMonitor counts the samples of a batch of type `OwnBatch` by its len() (16); pass "
        "`SpeedMonitor(samples_per_batch=lambda batch: ...)` if that is not its sample count."
    ]


@pytest.mark.parametrize("value", [float("nan"), "3", True, -1])
def test_a_users_function_must_return_a_finite_number(value: object) -> None:
    with pytest.raises(SpeedkitConfigError, match="`tokens_per_batch`"):
        number(value, "tokens_per_batch")


@dataclasses.dataclass
class _Padded:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


_Named = collections.namedtuple("_Named", "input_ids attention_mask")


@pytest.mark.parametrize(
    "container", [dict, _Padded, _Named], ids=["dict", "dataclass", "namedtuple"]
)
def test_padding_is_read_from_a_batch_of_any_kind_with_fields(container: type) -> None:
    """A dataclass or namedtuple batch's ``attention_mask`` was not read: its padding
    counted as tokens (tokens_per_sec 16/6 = 2.7x too high here)."""
    ids = torch.ones(4, 16, dtype=torch.long)
    mask = torch.zeros(4, 16, dtype=torch.long)
    mask[:, :6] = 1
    batch = container(input_ids=ids, attention_mask=mask)
    info = BatchReader().read(batch, [batch])
    assert (info.samples, info.tokens, int(info.throughput_tokens)) == (4, 64, 24)


def test_a_packed_dataclass_batch_counts_its_documents() -> None:
    @dataclasses.dataclass
    class Packed:
        input_ids: torch.Tensor
        cu_seqlens: torch.Tensor

    batch = Packed(torch.ones(1, 8, dtype=torch.long), torch.tensor([0, 3, 5, 8]))
    info = BatchReader().read(batch, [batch])
    assert (info.samples, info.tokens, int(info.throughput_tokens)) == (3, 8, 8)
