"""Attention swapped in checkpointed blocks: the recomputation runs what the forward ran.

A block that activation checkpointing wraps may itself be the attention swapped (its
attention written inline, found by tracing) or hold it (a submodule of any family).
Whichever is applied first, the checkpoint is the outer one: it keeps the block's
inputs and, in backward, runs the swapped forward again, so forward and recomputation
save the same tensors and the gradients are the unswapped, uncheckpointed model's.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import ActivationCheckpointing, AttentionSwap, swap_attention
from lightning_speedkit.attention.swap import swapped_modules
from lightning_speedkit.distributed import (
    checkpoint_blocks,
    checkpointed_blocks,
    uncheckpoint_blocks,
)

from .test_traced import CrossAttention


class InlineBlock(nn.Module):
    """Attention written in the block's own forward, projections named ``w_in``/``w_out``:
    only a trace finds it, and the block it finds is the one checkpointed."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.w_in, self.w_out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.w_in(self.norm1(x)).split(c, dim=2)
        q, k, v = (t.view(b, n, self.heads, c // self.heads).transpose(1, 2) for t in (q, k, v))
        weights = (q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)).softmax(dim=-1)
        x = x + self.w_out((weights @ v).transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))  # type: ignore[no-any-return]


class HoldingBlock(nn.Module):
    """Attention in a submodule only a trace finds (diffusers' old ``CrossAttention``)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attention = CrossAttention(dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.attention(self.norm(x))  # type: ignore[no-any-return]


class EncoderBlock(nn.TransformerEncoderLayer):
    """``nn.MultiheadAttention`` in the block: a family named, swapped at swap time."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__(dim, 4, 2 * dim, dropout=0.0, batch_first=True)


class Net(nn.Module):
    def __init__(self, block: Callable[[], nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(block() for _ in range(2))
        self.head = nn.Linear(32, 1)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean()


BLOCKS: dict[str, tuple[Callable[[], nn.Module], list[str], str]] = {
    "inline_traced": (InlineBlock, ["blocks.0", "blocks.1"], "traced"),
    "submodule_traced": (
        HoldingBlock,
        ["blocks.0.attention", "blocks.1.attention"],
        "traced",
    ),
    "multihead_attention": (
        EncoderBlock,
        ["blocks.0.self_attn", "blocks.1.self_attn"],
        "multihead_attention",
    ),
}


def _x(seed: int) -> Tensor:
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(seed))


def _grads(model: nn.Module, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad()
    loss = model(x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("order", ["swap_then_checkpoint", "checkpoint_then_swap"])
@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_gradients_equal_the_plain_model_in_either_order(
    kind: str, order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The traced swap of a checkpointed block ran its fused forward around the checkpoint:
    the recomputation in backward ran the block's own attention and torch raised
    ``CheckpointError`` at the second step. Checkpointed first, the block was reported
    ``already swapped`` and nothing was swapped."""
    make, swapped, family = BLOCKS[kind]
    model = Net(make)
    plain = copy.deepcopy(model)
    if order == "swap_then_checkpoint":
        report = swap_attention(model, "sdpa")
        assert checkpoint_blocks(model) == ["blocks.0", "blocks.1"]
    else:
        assert checkpoint_blocks(model) == ["blocks.0", "blocks.1"]
        report = swap_attention(model, "sdpa")
    assert report.skipped == []
    model.train()
    for step in range(3):  # the first call finds, the second runs fused (and recomputes)
        loss, grads = _grads(model, _x(step))
        plain_loss, plain_grads = _grads(plain, _x(step))
        torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == plain_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], plain_grads[name], rtol=1e-4, atol=1e-6,
                                       msg=f"step {step}: {name}")  # fmt: skip
    assert report.swapped == swapped
    assert all((m.family, m.status, m.checked) == (family, "active", "forward+backward")
               for m in report.modules)  # fmt: skip
    assert checkpointed_blocks(model) == ["blocks.0", "blocks.1"]
    calls: list[bool] = []
    fused = F.scaled_dot_product_attention

    def counting(*args: Any, **kwargs: Any) -> Tensor:
        calls.append(torch.is_grad_enabled())
        return fused(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    _grads(model, _x(5))
    assert calls == [True] * 4  # each block's attention fused in the forward and recomputation


def test_a_swap_reverted_in_a_checkpointed_block_leaves_the_checkpoint() -> None:
    model = Net(InlineBlock)
    checkpoint_blocks(model)
    report = swap_attention(model, "sdpa", sample=_x(0))
    swapped_modules(model)["blocks.0"].revert("by hand")
    assert report.swapped == ["blocks.1"]
    assert checkpointed_blocks(model) == ["blocks.0", "blocks.1"]
    assert uncheckpoint_blocks(model) == ["blocks.0", "blocks.1"]
    assert sorted(swapped_modules(model)) == ["blocks.1"]  # the swap outlives the checkpoint
    assert "forward" not in model.blocks[0].__dict__  # nothing of the kit's left on it
    plain = Net(InlineBlock)
    model.train()
    torch.testing.assert_close(_grads(model, _x(1))[0], _grads(plain, _x(1))[0])


class _Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net(InlineBlock)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.net(batch[0])  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(callbacks: list[L.Callback]) -> _Task:
    task = _Task()
    x = torch.randn(12, 8, 32, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(task, data)
    return task


@pytest.mark.parametrize("swap_first", [True, False], ids=["swap_first", "checkpoint_first"])
def test_both_callbacks_train_like_the_plain_run(swap_first: bool) -> None:
    swap = AttentionSwap("sdpa", verbose=False)
    checkpointing = ActivationCheckpointing(verbose=False)
    task = _fit([swap, checkpointing] if swap_first else [checkpointing, swap])
    plain = _fit([])
    assert swap.report is not None
    assert swap.report.swapped == ["net.blocks.0", "net.blocks.1"]
    assert checkpointing.checkpointed == ["net.blocks.0", "net.blocks.1"]
    for (name, p), ref in zip(task.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6, msg=name)


def test_swapping_checkpointed_blocks_reports_what_it_swapped() -> None:
    """Checkpointed first, each block was reported ``already swapped`` and nothing was."""
    model = Net(InlineBlock)
    checkpoint_blocks(model)
    report = swap_attention(model, "sdpa", sample=_x(0))
    assert report.skipped == []
    assert report.swapped == ["blocks.0", "blocks.1"]
    again = swap_attention(model, "sdpa", sample=_x(0))
    assert again.modules == []
    assert again.skipped == [("blocks.0", "already swapped"), ("blocks.1", "already swapped")]
