"""PackingCollate(separate_documents=True): no shifted label crosses into the next document."""

from __future__ import annotations

import pytest
import torch

from lightning_speedkit import SpeedkitConfigError, swap_attention
from lightning_speedkit.attention import packed_documents
from lightning_speedkit.data import PackingCollate

VOCAB = 40


def test_each_documents_first_label_is_ignored() -> None:
    samples = [{"input_ids": [1, 2, 3], "labels": [11, 12, 13]},
               {"input_ids": [4, 5], "labels": [14, 15]},
               {"input_ids": [6, 7, 8, 9], "labels": [16, 17, 18, 19]}]  # fmt: skip
    batch = PackingCollate(max_tokens=6, separate_documents=True)(samples)
    assert batch["labels"].tolist() == [[-100, 12, 13, -100, 15, -100],
                                        [-100, 17, 18, 19, -100, -100]]  # fmt: skip
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]]
    plain = PackingCollate(max_tokens=6)(samples)
    assert plain["labels"].tolist() == [[11, 12, 13, 14, 15, -100], [16, 17, 18, 19, -100, -100]]


def test_separating_documents_without_labels_is_refused() -> None:
    with pytest.raises(SpeedkitConfigError, match=r"`separate_documents=True` sets each "
                       r"document's first label to -100, but the samples carry no per-token "
                       r"'labels' \(got NoneType\)"):  # fmt: skip
        PackingCollate(max_tokens=6, separate_documents=True)([{"input_ids": [1, 2]}])
    with pytest.raises(SpeedkitConfigError, match=r"`separate_documents` must be True or False"):
        PackingCollate(max_tokens=6, separate_documents=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("separate", [True, False])
def test_a_packed_rows_own_loss_equals_the_documents_losses(separate: bool) -> None:
    """GPT-2's loss (labels shifted in the model) on packed rows vs each document alone."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    swap_attention(model, "sdpa")
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 3, 7, 4)]
    samples = [{"input_ids": d, "labels": d.clone(), "attention_mask": torch.ones_like(d)}
               for d in docs]  # fmt: skip
    batch = PackingCollate(max_tokens=10, separate_documents=separate)(samples)
    fields = ("input_ids", "position_ids", "attention_mask", "labels")
    with packed_documents(batch):
        packed = model(**{f: batch[f] for f in fields}).loss
    alone = [model(input_ids=d[None], labels=d[None]).loss for d in docs]
    weights = [len(d) - 1 for d in docs]  # a document of n tokens has n - 1 targets
    expected = sum(loss * w for loss, w in zip(alone, weights, strict=True)) / sum(weights)
    if separate:
        assert abs(packed.item() - expected.item()) <= 1e-5
    else:  # the last token of each document is asked for the next one's first
        assert abs(packed.item() - expected.item()) > 1e-3
