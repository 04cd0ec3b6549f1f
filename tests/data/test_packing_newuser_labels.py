"""PackingCollate's labels against the loss that reads them: the shifted-label trap, said.

Hugging Face's causal LMs shift ``labels`` inside the model. Packed with labels equal to
the tokens and ``separate_documents=False`` (the default), each document's last token is
trained to predict the next document's first: the loss is not the documents' own. Labels
shifted already (``input_ids = x[:-1]``, ``labels = x[1:]``) never pair across documents,
and ``separate_documents=True`` would drop a real target of each. Either mismatch is said
once.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lightning_speedkit.data import PackingCollate

VOCAB, LENGTHS = 50, (5, 3, 7, 2, 4, 6)
SEPARATE = "pass `separate_documents=True`"
ALREADY_SHIFTED = "shifted left by one already"


def _documents() -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]


def _llama_loss(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """A tiny Llama's packed loss, and the loss of its documents one by one."""
    transformers = pytest.importorskip("transformers")
    from lightning_speedkit import swap_attention
    from lightning_speedkit.attention import packed_documents

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    swap_attention(model, "sdpa")
    with packed_documents(batch), torch.no_grad():
        packed = model(**batch).loss
        alone = [model(input_ids=d[None], labels=d[None]).loss for d in _documents()]
    targets = torch.tensor([n - 1 for n in LENGTHS], dtype=torch.float32)
    return packed, (torch.stack(alone) * targets).sum() / targets.sum()


def test_labels_equal_to_the_tokens_without_separating_documents_are_said_once() -> None:
    samples = [{"input_ids": d, "labels": d.clone()} for d in _documents()]
    collate = PackingCollate(max_tokens=12)
    with pytest.warns(UserWarning, match=SEPARATE) as caught:
        batches = [collate(samples) for _ in range(2)]
    batch = batches[0]
    assert len([w for w in caught if SEPARATE in str(w.message)]) == 1
    packed, alone = _llama_loss(batch)
    assert (packed - alone).abs().item() > 1e-3  # the trap the warning names


def test_separating_documents_gives_the_documents_own_loss_and_says_nothing(
    recwarn: pytest.WarningsRecorder,
) -> None:
    samples = [{"input_ids": d, "labels": d.clone()} for d in _documents()]
    batch = PackingCollate(max_tokens=12, separate_documents=True)(samples)
    assert not [w for w in recwarn if "PackingCollate" in str(w.message)]
    packed, alone = _llama_loss(batch)
    assert (packed - alone).abs().item() <= 1e-5


def test_a_masked_prompt_is_still_hugging_faces_convention() -> None:
    """Instruction tuning: the prompt's labels -100, the answer's equal to the tokens."""
    samples = []
    for d in _documents():
        labels = d.clone()
        labels[: len(d) // 2] = -100
        samples.append({"input_ids": d, "labels": labels})
    with pytest.warns(UserWarning, match=SEPARATE):
        PackingCollate(max_tokens=12)(samples)


def test_labels_shifted_already_with_separate_documents_are_said_once() -> None:
    samples = [{"input_ids": d[:-1], "labels": d[1:]} for d in _documents()]
    collate = PackingCollate(max_tokens=12, separate_documents=True)
    with pytest.warns(UserWarning, match=ALREADY_SHIFTED) as caught:
        batches = [collate(samples) for _ in range(2)]
    batch = batches[0]
    assert len([w for w in caught if ALREADY_SHIFTED in str(w.message)]) == 1
    kept = int((batch["labels"] != -100).sum())
    assert kept == sum(LENGTHS) - 2 * len(LENGTHS)  # a real target of each document lost


@pytest.mark.parametrize("separate", [False, True])
def test_labels_of_another_kind_are_not_judged(
    separate: bool, recwarn: pytest.WarningsRecorder
) -> None:
    """Token-classification labels, and shifted labels packed as they are: nothing said."""
    docs = _documents()
    if separate:
        samples = [{"input_ids": d, "labels": d.clone()} for d in docs]
    else:
        samples = [{"input_ids": d[:-1], "labels": d[1:]} for d in docs]
    samples.append({"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([7, 7, 7])})
    PackingCollate(max_tokens=12, separate_documents=separate)(samples)
    assert not [w for w in recwarn if "PackingCollate" in str(w.message)]


def test_an_empty_sample_keeps_the_batchs_integer_dtypes_and_is_a_document_of_none() -> None:
    """An empty text tokenized without a BOS token is ``[]``, which torch reads as float32:
    the packed ``input_ids`` and ``labels`` came back float, and the embedding failed far
    from the cause."""
    samples = [
        {"input_ids": [], "labels": [], "weight": []},
        {"input_ids": [4, 5, 6], "labels": [4, 5, 6], "weight": [0.5, 1.0, 1.0]},
    ]
    batch = PackingCollate(max_tokens=4, token_fields=("labels", "weight"))(samples)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    assert batch["weight"].dtype == torch.float32
    assert batch["input_ids"].tolist() == [[4, 5, 6, 0]]
    assert batch["cu_seqlens"].tolist() == [0, 0, 3]  # the empty sample: a document of none
    assert batch["document_ids"].tolist() == [[1, 1, 1, -1]]
