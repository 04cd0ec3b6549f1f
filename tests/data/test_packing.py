from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_speedkit import SpeedkitConfigError
from lightning_speedkit.data import PackingCollate, document_mask
from lightning_speedkit.measure._batch_info import real_tokens


def _docs(lengths: list[int], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 100, (n,), generator=g), "label": torch.tensor(n)}
            for n in lengths]  # fmt: skip


def test_packing_fills_rows_and_records_the_boundaries() -> None:
    samples = _docs([5, 3, 6, 2, 7])
    batch = PackingCollate(max_tokens=8)(samples)
    assert batch["input_ids"].shape == (3, 8)  # [5,3] [6,2] [7]: greedy, in order
    assert batch["cu_seqlens"].tolist() == [0, 5, 8, 14, 16, 23]
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["max_seqlen"] == 7
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert batch["document_ids"][2].tolist() == [4, 4, 4, 4, 4, 4, 4, -1]
    real = batch["input_ids"][batch["document_ids"] >= 0]
    assert torch.equal(real, torch.cat([s["input_ids"] for s in samples]))  # no token lost
    assert batch["label"].tolist() == [5, 3, 6, 2, 7]


@pytest.mark.parametrize("causal", [True, False])
def test_attention_never_crosses_documents(causal: bool) -> None:
    """Masked attention over a packed row equals attention over each document alone."""
    torch.manual_seed(0)
    lengths = [4, 7, 3, 5, 6]
    samples = _docs(lengths)
    batch = PackingCollate(max_tokens=12)(samples)
    embed = torch.nn.Embedding(100, 16)
    q = k = v = embed(batch["input_ids"]).unsqueeze(1)  # (rows, 1 head, S, D)
    packed = F.scaled_dot_product_attention(
        q, k, v, attn_mask=document_mask(batch["document_ids"], causal)
    )
    for doc, sample in enumerate(samples):
        where = batch["document_ids"] == doc
        row = int(where.any(dim=1).nonzero())
        x = embed(sample["input_ids"]).view(1, 1, -1, 16)
        alone = F.scaled_dot_product_attention(x, x, x, is_causal=causal)[0, 0]
        torch.testing.assert_close(packed[row, 0][where[row]], alone)


def test_overlong_samples_are_cut_and_bad_input_is_named() -> None:
    collate = PackingCollate(max_tokens=4)
    cut = r"PackingCollate\(max_tokens=4\) cut a sample of 9 tokens to 4 \(its last 5 are not"
    with pytest.warns(UserWarning, match=cut) as caught:
        batch, _ = collate(_docs([9])), collate(_docs([7]))  # said once
    assert batch["cu_seqlens"].tolist() == [0, 4]
    assert len([w for w in caught if "cut a sample" in str(w.message)]) == 1
    with pytest.raises(SpeedkitConfigError, match="`max_tokens`"):
        PackingCollate(max_tokens=0)
    with pytest.raises(SpeedkitConfigError, match="found no 'tokens'"):
        PackingCollate(max_tokens=4, key="tokens")(_docs([2]))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_tokens": True}, r"`max_tokens` must be an integer >= 1, got True \(a bool\)"),
        ({"max_tokens": "8"}, r"`max_tokens` .* pass a number, e.g. 8, not the string '8'"),
        ({"max_tokens": 8, "pad_id": "0"}, r"`pad_id` must be an integer, got '0'"),
        ({"max_tokens": 8, "key": 3}, r"`key` must be a non-empty string, got 3"),
        ({"max_tokens": 8, "pad_values": {"labels": "x"}},
         r"`pad_values\['labels'\]` must be a number, got 'x'"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_at_construction(options: dict[str, Any], message: str) -> None:
    """Before, ``max_tokens=True`` packed 1-token rows and ``pad_id="0"`` raised a bare
    TypeError at the first batch."""
    with pytest.raises(SpeedkitConfigError, match=message):
        PackingCollate(**options)


def test_a_tokenizers_fields_are_packed_with_the_tokens_and_nothing_is_dropped() -> None:
    """Hugging Face causal-LM samples: per-token labels and mask go where their tokens go."""
    samples = [
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [5, 6, 7],
         "label": 1, "source": "a", "image": torch.zeros(2)},
        {"input_ids": [8, 9], "attention_mask": [1, 1], "labels": [8, 9],
         "label": 0, "source": "b", "image": torch.ones(2)},
        {"input_ids": [4, 3, 2, 1], "attention_mask": [1, 1, 1, 1], "labels": [4, 3, 2, -100],
         "label": 1, "source": "c", "image": torch.ones(2)},
    ]  # fmt: skip
    batch = PackingCollate(max_tokens=6, pad_values={"attention_mask": 0})(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [4, 3, 2, 1, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7, 8, 9, -100], [4, 3, 2, -100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]
    assert batch["label"].tolist() == [1, 0, 1]
    assert batch["source"] == ["a", "b", "c"]
    assert batch["image"].shape == (3, 2)


def test_a_field_that_can_be_neither_packed_nor_stacked_is_named() -> None:
    samples = [{"input_ids": torch.tensor([1, 2]), "pixels": torch.zeros(3, 2)},
               {"input_ids": torch.tensor([3]), "pixels": torch.zeros(4, 2)}]  # fmt: skip
    with pytest.raises(SpeedkitConfigError, match="cannot stack the samples' 'pixels'"):
        PackingCollate(max_tokens=4)(samples)
    with pytest.raises(SpeedkitConfigError, match="must be dicts"):
        PackingCollate(max_tokens=4)([torch.tensor([1, 2])])  # type: ignore[list-item]


def test_which_fields_are_packed_goes_by_name_not_by_length() -> None:
    """A 1-D field as long as the tokens by chance keeps its shape from batch to batch."""
    collate = PackingCollate(max_tokens=8)
    two = collate([{"input_ids": [1, 2], "span": torch.tensor([0, 1])},
                   {"input_ids": [3, 4], "span": torch.tensor([1, 1])}])  # fmt: skip
    assert two["span"].tolist() == [[0, 1], [1, 1]]  # stacked, as in any other batch
    own = PackingCollate(max_tokens=8, token_fields=["span"])
    assert own([{"input_ids": [1, 2], "span": [0, 1]}])["span"].tolist() == [[0, 1] + [0] * 6]
    with pytest.raises(SpeedkitConfigError, match="sample's is shape \\(3,\\) where its"):
        own([{"input_ids": [1, 2], "span": [0, 1, 2]}])
    with pytest.raises(SpeedkitConfigError, match="`token_fields`"):
        PackingCollate(max_tokens=8, token_fields="labels")


def test_labels_of_any_kind_keep_their_values_and_padding() -> None:
    """numpy labels (a `datasets` numpy format), uint8 labels, mixed int and float."""
    batch = PackingCollate(max_tokens=6)([
        {"input_ids": np.array([1, 2, 3]), "labels": np.array([1, 2, 3], dtype=np.uint8)},
        {"input_ids": np.array([4]), "labels": np.array([4], dtype=np.uint8),
         "weight": 0.5},
    ])  # fmt: skip
    assert batch["labels"].tolist() == [[1, 2, 3, 4, -100, -100]]  # not 156: uint8 wraps
    assert batch["weight"] == [None, 0.5]  # a field only a later sample has is kept
    mixed = PackingCollate(max_tokens=4, token_fields=["w"])(
        [{"input_ids": [1, 2], "w": [1, 1]}, {"input_ids": [3], "w": [0.5]}]
    )
    assert mixed["w"].tolist() == [[1.0, 1.0, 0.5, 0.0]]


def test_a_sample_of_shape_1_by_n_is_one_sequence() -> None:
    """Issue 33: a tokenizer's ``return_tensors="pt"`` gives each field as (1, N); such a
    sample is packed as its N tokens, its per-token fields with it."""
    collate = PackingCollate(max_tokens=4)
    batch = collate([
        {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.tensor([[1, 1]])},
        {"input_ids": torch.tensor([3]), "attention_mask": torch.tensor([1])},
    ])  # fmt: skip
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0]]
    assert batch["cu_seqlens"].tolist() == [0, 2, 3]


@pytest.mark.parametrize(
    ("tokens", "shape"),
    [(torch.ones(2, 5, dtype=torch.long), "(2, 5)"), (torch.tensor(7), "()")],
    ids=["a-batch", "a-scalar"],
)
def test_a_sample_that_is_not_one_sequence_is_named(tokens: torch.Tensor, shape: str) -> None:
    """Issue 33: a (B, N) sample raised torch's raw ``expand`` error."""
    with pytest.raises(SpeedkitConfigError) as raised:
        PackingCollate(max_tokens=8)([{"input_ids": torch.tensor([1, 2])}, {"input_ids": tokens}])
    message = str(raised.value)
    expected = "PackingCollate packs one sequence per sample, but sample 1's 'input_ids' has"
    assert message.startswith(f"{expected} shape {shape};")
    assert "expand" not in message


def test_first_fit_packs_longest_first_into_the_first_row_with_room() -> None:
    samples = [{"input_ids": torch.arange(1, n + 1), "labels": torch.full((n,), n), "id": n}
               for n in (3, 5, 2, 4)]  # fmt: skip
    in_order = PackingCollate(max_tokens=7)(samples)
    assert in_order["input_ids"].shape == (3, 7)  # 3 | 5 2 | 4: 7 of 21 padding
    batch = PackingCollate(max_tokens=7, first_fit=True)(samples)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 1, 2], [1, 2, 3, 4, 1, 2, 3]]
    assert batch["id"].tolist() == [5, 2, 4, 3]  # the documents in the order placed
    assert batch["labels"].tolist() == [[5] * 5 + [2] * 2, [4] * 4 + [3] * 3]
    assert batch["cu_seqlens"].tolist() == [0, 5, 7, 11, 14]
    assert batch["document_ids"].tolist() == [[0] * 5 + [1] * 2, [2] * 4 + [3] * 3]
    assert batch["position_ids"][1].tolist() == [0, 1, 2, 3, 0, 1, 2]


def test_first_fit_must_be_a_bool() -> None:
    with pytest.raises(SpeedkitConfigError, match="`first_fit` must be True or False"):
        PackingCollate(max_tokens=4, first_fit="yes")  # type: ignore[arg-type]


def test_samples_tokenized_with_padding_are_packed_without_it() -> None:
    """A tokenizer called with ``padding="max_length"``: its pads would be trained on as
    tokens of a document, and counted as tokens."""
    plain = [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [5, 6, 7]},
             {"input_ids": [8, 9], "attention_mask": [1, 1], "labels": [8, 9]}]  # fmt: skip
    padded = [
        {"input_ids": [5, 6, 7, 0], "attention_mask": [1, 1, 1, 0], "labels": [5, 6, 7, -100]},
        {"input_ids": [0, 0, 8, 9], "attention_mask": [0, 0, 1, 1], "labels": [-100, -100, 8, 9]},
    ]  # right and left padding
    collate = PackingCollate(max_tokens=6)
    with pytest.warns(UserWarning, match=r"samples came padded \(3 tokens of this batch"):
        got = collate(padded)
    want = PackingCollate(max_tokens=6)(plain)
    assert got.keys() == want.keys()
    for field in ("input_ids", "attention_mask", "labels", "document_ids", "position_ids"):
        assert torch.equal(got[field], want[field]), field
    assert got["cu_seqlens"].tolist() == [0, 3, 5]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        collate(padded)
    assert int(real_tokens(got, [got["input_ids"]])) == 5


def test_numpy_fields_become_tensors_as_default_collate_makes_them() -> None:
    """A dataset of NumPy samples (an image array, an ``np.int64`` class label): its other
    fields were kept as lists, where ``default_collate``, which such a dataset was written
    against, stacks arrays and makes NumPy numbers a tensor, NumPy's dtype kept."""
    from torch.utils.data import default_collate

    samples = [
        {"input_ids": np.array([1, 2, 3], dtype=np.int32), "image": np.full((2, 2), 0.5),
         "label": np.int64(3), "score": np.float32(0.25), "flag": np.bool_(True), "name": "a"},
        {"input_ids": np.array([4], dtype=np.int32), "image": np.ones((2, 2)),
         "label": np.int64(4), "score": np.float32(1.5), "flag": np.bool_(False), "name": "b"},
    ]  # fmt: skip
    batch = PackingCollate(max_tokens=8)(samples)
    for field in ("image", "label", "score", "flag"):
        expected = default_collate([sample[field] for sample in samples])
        assert isinstance(batch[field], torch.Tensor), field
        assert batch[field].dtype == expected.dtype, field
        assert torch.equal(batch[field], expected), field
    assert batch["image"].shape == (2, 2, 2)
    assert batch["label"].tolist() == [3, 4]
    assert batch["name"] == ["a", "b"]  # not numbers: listed, as before
    words = [{"input_ids": [1], "tag": np.array(["x"])}, {"input_ids": [2], "tag": np.array(["y"])}]
    assert [t.tolist() for t in PackingCollate(max_tokens=4)(words)["tag"]] == [["x"], ["y"]]
