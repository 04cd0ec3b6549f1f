"""Packed batches in the containers a user's own collate returns, not a plain dict.

A dataclass, a namedtuple, ``(ids, labels, {"cu_seqlens", "document_ids"})``, a packed
dict under a key of an outer one, a list holding it, a ``BatchEncoding``: the packing
fields are found wherever they sit, and the losses equal each document's alone. Missed,
every token would attend across the documents of its row, silently (a gap of about
0.04 in the loss of the probe that found it). Two sets of fields that disagree are
refused, not one of them picked.
"""

from __future__ import annotations

import copy
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap, swap_attention
from lightning_speedkit.attention import packed_documents
from lightning_speedkit.attention._documents import documents_of
from lightning_speedkit.data import PackingCollate
from lightning_speedkit.errors import SpeedkitConfigError

from .test_packed_documents import (
    LENGTHS,
    MAX_TOKENS,
    NanoGPT,
    _model,
    _one_by_one,
    _samples,
    _Task,
    _token_losses,
)

FIELDS = ("input_ids", "position_ids", "document_ids", "cu_seqlens", "max_seqlen", "labels",
          "attention_mask")  # fmt: skip


@dataclass
class PackedBatch:
    input_ids: Tensor
    position_ids: Tensor
    document_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    labels: Tensor
    attention_mask: Tensor


@dataclass
class _Wrapped:
    inputs: dict[str, Any]


PackedTuple = namedtuple("PackedTuple", FIELDS)


def _batch_encoding(batch: dict[str, Any]) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.BatchEncoding(batch)


#: Each container kind: the packed dict PackingCollate returned, as a user's collate gives it.
CONTAINERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "dataclass": lambda b: PackedBatch(**b),
    "namedtuple": lambda b: PackedTuple(**b),
    "tuple_of_ids_labels_dict": lambda b: (
        b["input_ids"], b["labels"],
        {"cu_seqlens": b["cu_seqlens"], "document_ids": b["document_ids"]},
    ),
    "nested_dict": lambda b: {"inputs": b},
    "list": lambda b: [b],
    "dataclass_in_dict": lambda b: {"batch": PackedBatch(**b), "step": 3},
    "batch_encoding": _batch_encoding,
}  # fmt: skip


def _packed() -> dict[str, Any]:
    batch = PackingCollate(max_tokens=MAX_TOKENS)(_samples())
    assert set(batch) == set(FIELDS)  # what the containers above hold
    assert batch["input_ids"].shape == (3, MAX_TOKENS)  # several documents per row
    return batch


@pytest.mark.parametrize("kind", list(CONTAINERS))
def test_packed_losses_in_any_container_equal_each_document_alone(kind: str) -> None:
    model = _model("nanogpt")
    batch = _packed()
    container = CONTAINERS[kind](batch)
    with packed_documents(container) as documents:
        packed = _token_losses(model, batch)
    assert packed.shape == (sum(LENGTHS),)
    assert (packed - _one_by_one(model, _samples())).abs().max().item() <= 1e-5
    assert documents == documents_of(batch)  # the same documents as the plain dict's


def test_flattened_document_ids_take_their_rows_from_a_sibling_container() -> None:
    """``document_ids`` flattened in one dict, the rows' ``input_ids`` in another."""
    model = _model("nanogpt")
    batch = _packed()
    container = {
        "inputs": {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]},
        "packing": {"document_ids": batch["document_ids"].reshape(-1)},
    }
    with packed_documents(container) as documents:
        packed = _token_losses(model, batch)
    assert (packed - _one_by_one(model, _samples())).abs().max().item() <= 1e-5
    assert documents == documents_of(batch)


def test_the_same_fields_reached_twice_are_one_set() -> None:
    batch = _packed()
    twice = {"a": batch, "b": dict(batch), "c": PackedBatch(**batch)}
    assert documents_of(twice) == documents_of(batch)


def test_two_sets_of_fields_that_disagree_are_refused() -> None:
    batch = _packed()
    other = PackingCollate(max_tokens=MAX_TOKENS)(list(reversed(_samples())))
    refused = (
        r"^The batch holds two different sets of packing fields \(`cu_seqlens`/`document_ids`\), "
        r"at `batch\['text'\]` and at `batch\['code'\]\.inputs`, and the documents they give "
        r"differ; keep only the set the batch's rows were packed with \(drop or rename the "
        r"other\), so one set of documents is kept apart\.$"
    )
    with pytest.raises(SpeedkitConfigError, match=refused):
        documents_of({"text": batch, "code": _Wrapped(other)})


def test_a_container_without_packing_fields_is_not_packed() -> None:
    ids = torch.zeros(2, 4, dtype=torch.long)
    for batch in ((ids, ids), {"inputs": {"input_ids": ids}}, [ids, [ids, {"x": 1}]], "text"):
        assert documents_of(batch) is None


def test_a_batch_that_holds_itself_is_walked_once() -> None:
    batch: dict[str, Any] = dict(_packed())
    batch["self"] = batch
    assert documents_of(batch) == documents_of(_packed())


class _DataclassTask(_Task):
    """Training on the dataclass a user's collate returns."""

    def training_step(self, batch: PackedBatch, batch_idx: int) -> Tensor:  # type: ignore[override]
        return super().training_step(vars(batch), batch_idx)


def test_attention_swap_keeps_documents_apart_in_a_dataclass_batch() -> None:
    torch.manual_seed(0)
    model = NanoGPT()
    reference = copy.deepcopy(model)
    task = _DataclassTask(model)
    collate = PackingCollate(MAX_TOKENS)
    loader = DataLoader(_samples(), batch_size=len(LENGTHS),
                        collate_fn=lambda items: PackedBatch(**collate(items)))  # fmt: skip
    swap = AttentionSwap(backend="sdpa", measure=False, verbose=False)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[swap])  # fmt: skip
    trainer.fit(task, loader)
    assert task.seen == [True]
    swap_attention(reference, "sdpa")
    (packed,) = task.losses
    assert (packed - _one_by_one(reference, _samples())).abs().max().item() <= 1e-5
