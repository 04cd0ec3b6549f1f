"""A Hugging Face causal LM trained packed with the kit's other levers on at once.

Gradient accumulation, ``ActivationCheckpointing`` and ``SpeedMonitor`` beside
``AttentionSwap``, ``model(**batch)`` on ``PackingCollate(separate_documents=True)``
batches: each micro-batch's loss is its documents' own, and the accumulated gradients
are those of the documents run one by one (fp32); under ``bf16-mixed`` on CPU the losses
stay within the swap's bf16 tolerance of the fp32 documents alone.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_speedkit import ActivationCheckpointing, AttentionSwap, SpeedMonitor, swap_attention
from lightning_speedkit.data import PackingCollate

transformers = pytest.importorskip("transformers")

VOCAB, LENGTHS = 50, (5, 3, 7, 2, 4, 6)


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _documents(seed: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]


class _Task(L.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[Tensor] = []
        self.grads: list[dict[str, Tensor]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.losses.append(loss.detach().float().clone())
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grads.append({n: p.grad.clone() for n, p in self.model.named_parameters()})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _alone(model: nn.Module, docs: list[Tensor]) -> Tensor:
    losses = torch.stack([model(input_ids=d[None], labels=d[None]).loss for d in docs])
    targets = torch.tensor([len(d) - 1 for d in docs], dtype=torch.float32)
    return (losses * targets).sum() / targets.sum()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_accumulation_checkpointing_and_speed_monitor_packed_equal_one_by_one(
    precision: str,
) -> None:
    torch.manual_seed(0)
    model = _llama()
    reference = copy.deepcopy(model)
    docs = _documents(0) + _documents(1)
    samples = [{"input_ids": d, "labels": d} for d in docs]
    collate = PackingCollate(max_tokens=12, separate_documents=True)
    task = _Task(model)
    trainer = L.Trainer(
        max_steps=1, accumulate_grad_batches=2, precision=precision, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[AttentionSwap(backend="sdpa", verbose=False),
                   ActivationCheckpointing(blocks="auto"), SpeedMonitor(log_every_n_steps=1)],
    )  # fmt: skip
    trainer.fit(task, DataLoader(samples, batch_size=len(LENGTHS), collate_fn=collate))
    swap_attention(reference, "sdpa")
    expected = [_alone(reference, docs[: len(LENGTHS)]), _alone(reference, docs[len(LENGTHS) :])]
    assert len(task.losses) == 2
    if precision == "bf16-mixed":
        for packed, alone in zip(task.losses, expected, strict=True):
            assert (packed - alone).abs().item() <= 3e-2 * alone.abs().item()
        return
    for packed, alone in zip(task.losses, expected, strict=True):
        assert (packed - alone).abs().item() <= 1e-5
    reference.zero_grad()
    (sum(expected) / 2).backward()  # Lightning scales each micro-batch by 1 / 2
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert max((task.grads[0][n] - g).abs().max().item() for n, g in grads.items()) <= 1e-5
