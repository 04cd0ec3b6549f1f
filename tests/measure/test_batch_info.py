"""What SpeedMonitor reads of a batch, on its own: samples, tokens, signature."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_speedkit import SpeedkitConfigError
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


@pytest.mark.parametrize("value", [float("nan"), "3", True, -1])
def test_a_users_function_must_return_a_finite_number(value: object) -> None:
    with pytest.raises(SpeedkitConfigError, match="`tokens_per_batch`"):
        number(value, "tokens_per_batch")
