"""AttentionSwap on a LightningModule that builds its layers in ``configure_model``.

Lightning calls the callbacks' ``setup`` before ``configure_model`` (its recommended
place for large models): AttentionSwap looked for attention in ``setup``, found none,
printed an empty report and trained with every attention unswapped.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import AttentionSwap, RegionalCompile
from lightning_speedkit.attention.swap import swapped_modules


class LateEncoder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is None:
            torch.manual_seed(0)
            layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.net = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.net is not None
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(*callbacks: L.Callback) -> tuple[LateEncoder, list[float]]:
    module, losses = LateEncoder(), []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            losses.append(float(args[1]["loss"]))  # (module, outputs, batch, index)

    trainer = L.Trainer(
        accelerator="cpu", max_steps=3, callbacks=[*callbacks, Losses()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = TensorDataset(torch.randn(12, 5, 16, generator=torch.Generator().manual_seed(1)))
    trainer.fit(module, DataLoader(data, batch_size=4))
    return module, losses


def test_attention_built_in_configure_model_is_swapped_and_trains_as_before() -> None:
    _, plain_losses = _fit()
    swap = AttentionSwap(backend="sdpa", verbose=False)
    module, losses = _fit(swap)
    assert swap.report is not None
    assert sorted(swapped_modules(module)) == ["net.layers.0.self_attn", "net.layers.1.self_attn"]
    assert "configure_model" not in vars(module)  # the module's own hook again
    assert losses == pytest.approx(plain_losses, abs=1e-5)
    assert plain_losses[-1] < plain_losses[0]


def test_beside_regional_compile_both_act_after_configure_model() -> None:
    swap = AttentionSwap(backend="sdpa", verbose=False)
    compile_ = RegionalCompile(backend="eager", verbose=False)
    module, _ = _fit(swap, compile_)
    assert len(swapped_modules(module)) == 2
    assert compile_.compiled == ["net.layers.0", "net.layers.1"]
