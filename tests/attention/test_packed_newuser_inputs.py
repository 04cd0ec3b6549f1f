"""Packing fields as a user's own collate writes them: lists, arrays, other dtypes, shapes.

Each is either read as the documents it spells (and the losses equal one by one) or
refused with the fix; none is skipped, which would let every token attend across the
documents of its row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from lightning_speedkit.attention import packed_documents
from lightning_speedkit.attention._documents import documents_of
from lightning_speedkit.data import PackingCollate
from lightning_speedkit.errors import SpeedkitConfigError

from .test_packed_documents import MAX_TOKENS, _model, _one_by_one, _samples, _token_losses

#: The rows PackingCollate(12) makes of LENGTHS (5, 3, 7, 2, 4, 6), padding at each end.
LENGTHS_BY_ROW = [[5, 3, 4], [7, 2, 3], [4, 6, 2]]
#: ``cu_seqlens`` over the whole rows, each row's padding a span of its own.
WHOLE_ROWS_CU = [0, 5, 8, 12, 19, 21, 24, 28, 34, 36]
#: ``document_ids`` counted from 0 in each row, beside the batch's own ``cu_seqlens``.
PER_ROW_IDS = [
    [0] * 5 + [1] * 3 + [-1] * 4,
    [0] * 7 + [1] * 2 + [-1] * 3,
    [0] * 4 + [1] * 6 + [-1] * 2,
]


def _batch() -> dict[str, Any]:
    return PackingCollate(MAX_TOKENS)(_samples())


def _only(batch: dict[str, Any], *fields: str) -> dict[str, Any]:
    keep = ("input_ids", "labels", "position_ids", "attention_mask", *fields)
    return {k: v for k, v in batch.items() if k in keep}


@pytest.mark.parametrize(
    "spell",
    [
        pytest.param(lambda b: _only(b) | {"cu_seqlens": WHOLE_ROWS_CU}, id="cu-list"),
        pytest.param(lambda b: _only(b) | {"cu_seqlens": tuple(WHOLE_ROWS_CU)}, id="cu-tuple"),
        pytest.param(lambda b: _only(b) | {"cu_seqlens": np.array(WHOLE_ROWS_CU)}, id="cu-numpy"),
        pytest.param(
            lambda b: _only(b) | {"cu_seqlens": torch.tensor(WHOLE_ROWS_CU)}, id="cu-int64"
        ),
        pytest.param(
            lambda b: _only(b) | {"document_ids": b["document_ids"].tolist()}, id="ids-list"
        ),
        pytest.param(
            lambda b: _only(b) | {"document_ids": b["document_ids"].numpy()}, id="ids-numpy"
        ),
        pytest.param(
            lambda b: _only(b) | {"document_ids": b["document_ids"].int()}, id="ids-int32"
        ),
        pytest.param(
            lambda b: _only(b) | {"document_ids": b["document_ids"].flatten()},
            id="ids-flattened-over-the-rows",
        ),
        pytest.param(
            lambda b: {
                **b,
                "document_ids": torch.where(b["document_ids"] >= 0, b["document_ids"] + 7, -1),
            },
            id="ids-from-7-with-cu",
        ),
        pytest.param(
            lambda b: {**b, "document_ids": torch.tensor(PER_ROW_IDS)},
            id="ids-restarting-per-row-with-cu",
        ),
    ],
)
def test_packing_fields_spelled_otherwise_keep_documents_apart(spell: Any) -> None:
    batch = spell(_batch())
    documents = documents_of(batch)
    assert documents is not None
    assert [[e - s for s, e in row] for row in documents.spans] == LENGTHS_BY_ROW
    model = _model("nanogpt")
    with packed_documents(batch), torch.no_grad():
        packed = _token_losses(model, batch)
    alone = _one_by_one(model, _samples())
    assert (packed - alone).abs().max().item() <= 1e-5


def test_a_document_going_on_into_the_next_row_agrees_with_cu_seqlens() -> None:
    """Pretraining's concatenate-and-chunk: one id over a row boundary is one document."""
    ids = torch.tensor([[0, 0, 0, 1], [1, 1, 2, 2]])
    documents = documents_of({"document_ids": ids, "cu_seqlens": torch.tensor([0, 3, 6, 8])})
    assert documents is not None
    assert documents.spans == (((0, 3), (3, 4)), ((0, 2), (2, 4)))


def test_one_rows_cu_seqlens_stacked_by_a_dataloader_is_that_rows() -> None:
    """A dataset of rows packed ahead of time, batch_size=1: ``cu_seqlens`` is ``(1, n)``."""
    batch = {
        "input_ids": torch.zeros(1, 6, dtype=torch.long),
        "cu_seqlens": torch.tensor([[0, 2, 6]]),
    }
    documents = documents_of(batch)
    assert documents is not None
    assert documents.spans == (((0, 2), (2, 6)),)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("cu_seqlens", torch.tensor([[0, 3, 6], [0, 2, 6]]), r"must be 1-D.*got shape \(2, 3\)"),
        ("cu_seqlens", torch.tensor([0.0, 3.0, 6.0]), "must hold integers.*torch.float32"),
        ("document_ids", [[0, 0], [1]], "must hold integers.*list"),
        ("seq_idx", "0 0 1", "`seq_idx` must hold integers"),
    ],
)
def test_packing_fields_that_spell_no_documents_are_refused(
    field: str, value: Any, message: str
) -> None:
    batch = {"input_ids": torch.zeros(2, 6, dtype=torch.long), field: value}
    with pytest.raises(SpeedkitConfigError, match=message):
        documents_of(batch)
