"""Swapping attention draws no number of the user's run.

A seeded run shuffles its loader with a seed drawn from torch's global generator as each
epoch starts. The swap's checks built their synthetic inputs from that generator (a
Hugging Face model's token ids, ``nn.MultiheadAttention``'s keys and values of another
width), so adding AttentionSwap to a seeded GPT-2 run changed its data order and every
loss after, though every parity error was 0.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit import AttentionSwap, swap_attention

from ..helpers.hf_tiny import tiny_model

pytest.importorskip("transformers")

_gpt2 = tiny_model("GPT2Config", "GPT2LMHeadModel", vocab_size=64, n_positions=32, n_embd=32,
                   n_layer=2, n_head=4)  # fmt: skip


@pytest.mark.parametrize(
    "make",
    [_gpt2, lambda: nn.MultiheadAttention(16, 2, kdim=8, vdim=12, batch_first=True)],
    ids=["gpt2", "mha-kdim"],
)
def test_swap_attention_leaves_the_global_generator_as_it_was(make: Any) -> None:
    model = make()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    report = swap_attention(model, "sdpa")
    assert report.swapped  # the checks ran
    assert torch.equal(torch.get_rng_state(), before)


class Tokens(Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(index)
        return {"input_ids": torch.randint(0, 64, (12,), generator=g), "index": index}


class LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _gpt2()
        self.seen: list[list[int]] = []
        self.losses: list[Tensor] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        self.seen.append(batch["index"].tolist())
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.losses.append(loss.detach())
        return loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(callbacks: list[L.Callback]) -> LM:
    L.seed_everything(0, verbose=False)
    model = LM()
    trainer = L.Trainer(max_epochs=2, limit_train_batches=3, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)  # fmt: skip
    trainer.fit(model, DataLoader(Tokens(), batch_size=4, shuffle=True))
    return model


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_a_seeded_fit_sees_the_same_batches_with_attention_swap(backend: str) -> None:
    plain = _fit([])
    swapped = _fit([AttentionSwap(backend=backend, verbose=False)])
    assert swapped.seen == plain.seen  # both epochs' orders
    # transformers' GPT-2 already calls SDPA: the swap runs the same kernel
    pairs = zip(plain.losses, swapped.losses, strict=True)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in pairs)
