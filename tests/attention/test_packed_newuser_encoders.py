"""More Hugging Face encoders packed: each token's output that of its document alone.

RoBERTa and XLM-R build their positions themselves by counting the non-padding tokens of
a row from ``padding_idx + 1``: packed, the count ran on from one document into the next
(outputs off by about 2). The count is restarted per document now; the batch's
``position_ids``, which count from 0, are said to be off by ``padding_idx + 1`` there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_speedkit import swap_attention
from lightning_speedkit.attention import _documents as documents_module
from lightning_speedkit.attention import packed_documents
from lightning_speedkit.data import PackingCollate
from tests.helpers.hf_tiny import tiny_model

transformers = pytest.importorskip("transformers")

VOCAB, LENGTHS = 50, (5, 3, 7, 2, 4, 6)
ENCODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=64)  # fmt: skip


ENCODERS: dict[str, Callable[[], nn.Module]] = {
    "roberta": tiny_model("RobertaConfig", "RobertaModel", pad_token_id=1, **ENCODER),
    "xlm-roberta": tiny_model("XLMRobertaConfig", "XLMRobertaModel", pad_token_id=1, **ENCODER),
    "distilbert": tiny_model("DistilBertConfig", "DistilBertModel", vocab_size=VOCAB, dim=32,
                         n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64),
    "electra": tiny_model("ElectraConfig", "ElectraModel", embedding_size=32, **ENCODER),
    "modernbert": tiny_model("ModernBertConfig", "ModernBertModel", pad_token_id=0,
                         global_attn_every_n_layers=1, **ENCODER),
    "t5-encoder": tiny_model("T5Config", "T5EncoderModel", vocab_size=VOCAB, d_model=32, d_kv=8,
                         d_ff=64, num_layers=2, num_heads=4),
}  # fmt: skip


def _documents() -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in LENGTHS]


def _packed(model: nn.Module, max_tokens: int, with_positions: bool) -> tuple[Any, Tensor]:
    samples = [{"input_ids": d, "attention_mask": torch.ones_like(d)} for d in _documents()]
    batch = PackingCollate(max_tokens=max_tokens)(samples)
    fields = ["input_ids", "attention_mask"] + (["position_ids"] if with_positions else [])
    with packed_documents(batch), torch.no_grad():
        out = model(**{f: batch[f] for f in fields}).last_hidden_state
    return batch, out


def _max_diff(model: nn.Module, batch: dict[str, Any], out: Tensor) -> float:
    ids, worst = batch["document_ids"], 0.0
    with torch.no_grad():
        for i, d in enumerate(_documents()):
            r, c = (ids == i).nonzero()[0].tolist()
            alone = model(input_ids=d[None], attention_mask=torch.ones_like(d)[None])
            worst = max(
                worst, (out[r, c : c + len(d)] - alone.last_hidden_state[0]).abs().max().item()
            )
    return worst


@pytest.mark.parametrize("max_tokens", [12, sum(LENGTHS)], ids=["3rows", "1row"])
@pytest.mark.parametrize("family", list(ENCODERS))
def test_encoder_packed_gives_each_tokens_output_of_one_by_one(
    family: str, max_tokens: int
) -> None:
    torch.manual_seed(0)
    model = ENCODERS[family]().eval()
    assert swap_attention(model, "sdpa").swapped
    batch, out = _packed(model, max_tokens, with_positions=False)
    assert _max_diff(model, batch, out) <= 1e-5


def test_positions_counted_from_padding_idx_are_restarted_not_run_on() -> None:
    """Without the restart RoBERTa's positions run on across the row: far from alone."""
    torch.manual_seed(0)
    model = ENCODERS["roberta"]().eval()
    swap_attention(model, "sdpa")
    samples = [{"input_ids": d, "attention_mask": torch.ones_like(d)} for d in _documents()]
    batch = PackingCollate(max_tokens=12)(samples)
    with torch.no_grad():  # the documents not active: the model's own count runs on
        run_on = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert _max_diff(model, batch, run_on.last_hidden_state) > 0.1


def test_the_batchs_positions_given_to_roberta_are_said_off_by_padding_idx_plus_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(documents_module, "_WARNED", set())  # said once per process: afresh here
    torch.manual_seed(0)
    model = ENCODERS["roberta"]().eval()
    swap_attention(model, "sdpa")
    with pytest.warns(UserWarning, match=r"count from 0: every position is off by 2"):
        _packed(model, 12, with_positions=True)
