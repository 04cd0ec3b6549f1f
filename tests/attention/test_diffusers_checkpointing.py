"""diffusers' own gradient checkpointing on a model whose attention only tracing finds.

``enable_gradient_checkpointing()`` gives every module with a ``gradient_checkpointing``
flag a ``_gradient_checkpointing_func``, which the module calls on its blocks
(``torch.utils.checkpoint`` of ``block.__call__``). With diffusers' classic
``AttnProcessor`` the attention is found by tracing the model's first call, and swapped
at that call's end: the checkpoints taken in the call recomputed, in backward, the
swapped attention instead of the attention the call ran, and torch raised
``CheckpointError`` at the first step. Such a call is now traced ahead of itself (no
gradients, so no checkpoint), and then runs swapped, checkpointed as the user asked.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import ActivationCheckpointing, AttentionSwap, swap_attention
from lightning_speedkit.attention import _discovery
from tests.helpers.diffusers_like import ClassicProcessor, Transformer2D
from tests.helpers.sdpa_count import CountSdpa, assert_equal_grads

LAYERS = 2
SWAPPED = [f"transformer_blocks.{i}.attn{j}" for i in range(LAYERS) for j in (1, 2)]


def _model() -> Transformer2D:
    torch.manual_seed(0)
    return Transformer2D(layers=LAYERS, processor=ClassicProcessor).train()


def _inputs(seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 16, 32, generator=generator), torch.randn(2, 5, 24, generator=generator)


def _grads(model: nn.Module, seed: int) -> Tensor:
    """The whole model's gradient, one vector."""
    model.zero_grad(set_to_none=True)
    model(*_inputs(seed)).square().mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


class _Counted:
    """A checkpoint function (diffusers' signature) that counts its calls with gradients."""

    def __init__(self, reentrant: bool) -> None:
        self.reentrant, self.calls = reentrant, 0

    def __call__(self, block: Callable[..., Any], *args: Any) -> Any:
        self.calls += torch.is_grad_enabled()
        checkpoint = torch.utils.checkpoint.checkpoint
        return checkpoint(block.__call__, *args, use_reentrant=self.reentrant)


@pytest.mark.parametrize("enabled", ["before_swap", "after_swap"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_model_swaps_on_its_first_step_with_the_plain_gradients(
    enabled: str, reentrant: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    plain = copy.deepcopy(model)  # neither swapped nor checkpointed
    checkpoint = _Counted(reentrant)
    if enabled == "before_swap":
        model.enable_gradient_checkpointing(checkpoint)
        report = swap_attention(model, "sdpa", measure=False)
    else:  # enabled once the swap is installed, before the first call traces the model
        report = swap_attention(model, "sdpa", measure=False)
        model.enable_gradient_checkpointing(checkpoint)
    assert report.swapped == []  # found by the first call
    for step in range(2):
        assert_equal_grads(_grads(model, step), _grads(plain, step), f"step {step}")
        # The first step was checkpointed too: the trace ran ahead of it, without gradients.
        assert checkpoint.calls == LAYERS * (step + 1)
    assert report.swapped == SWAPPED
    assert {(m.family, m.status, m.checked) for m in report.modules} == {
        ("traced", "active", "forward+backward")
    }
    sdpa = CountSdpa(monkeypatch)
    _grads(model, 2)
    assert (sdpa.forward, sdpa.recomputed) == (2 * LAYERS, 2 * LAYERS)  # recomputed fused
    functions = {m.__dict__.get("_gradient_checkpointing_func") for m in model.modules()}
    assert functions <= {None, checkpoint}  # nothing of the kit left on the model


def test_a_call_traced_as_it_runs_runs_its_checkpointed_blocks_unchecked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the call cannot be traced ahead (FSDP2 units; a forward that raises on the
    copies), the model's own checkpoint functions run their blocks unchecked for that call,
    as the kit's own checkpoints do: nothing is recomputed of the attention it ran."""
    monkeypatch.setattr(_discovery.Discovery, "_trace_ahead", lambda *args: False)
    model = _model()
    plain = copy.deepcopy(model)
    checkpoint = _Counted(reentrant=False)
    model.enable_gradient_checkpointing(checkpoint)
    report = swap_attention(model, "sdpa", measure=False)
    assert_equal_grads(_grads(model, 0), _grads(plain, 0), "traced step")
    assert checkpoint.calls == 0
    assert_equal_grads(_grads(model, 1), _grads(plain, 1), "swapped step")
    assert checkpoint.calls == LAYERS
    assert report.swapped == SWAPPED
    assert all(m.__dict__.get("_gradient_checkpointing_func") in (None, checkpoint)
               for m in model.modules())  # fmt: skip


class _Task(L.LightningModule):
    def __init__(self, checkpointing: bool) -> None:
        super().__init__()
        self.net = _model()
        if checkpointing:
            self.net.enable_gradient_checkpointing()
        self.losses: list[float] = []

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, context = batch
        loss = self.net(x, context).square().mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(checkpointing: bool, callbacks: list[Any]) -> _Task:
    task = _Task(checkpointing)
    x, context = (torch.cat(t) for t in zip(*(_inputs(seed) for seed in range(3)), strict=True))
    trainer = L.Trainer(
        accelerator="cpu", max_steps=3, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(task, DataLoader(TensorDataset(x, context), batch_size=2))
    return task


@pytest.mark.parametrize("kit_checkpointing", [False, True], ids=["alone", "with_kit_ac"])
def test_attention_swap_trains_a_checkpointed_model_like_the_plain_one(
    kit_checkpointing: bool,
) -> None:
    callbacks: list[Any] = [AttentionSwap(backend="sdpa", verbose=False)]
    if kit_checkpointing:
        callbacks.append(ActivationCheckpointing())
    swapped = _fit(True, callbacks)
    plain = _fit(False, [])
    torch.testing.assert_close(swapped.losses, plain.losses, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(swapped.net.named_parameters(), plain.net.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert callbacks[0].report.swapped == [f"net.{name}" for name in SWAPPED]


def test_real_diffusers_unet_with_classic_processor() -> None:
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.attention_processor import AttnProcessor

    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        norm_num_groups=8, attention_head_dim=8,
    ).train()  # fmt: skip
    unet.set_attn_processor(AttnProcessor())
    plain = copy.deepcopy(unet)
    unet.enable_gradient_checkpointing()
    report = swap_attention(unet, "sdpa", measure=False)
    generator = torch.Generator().manual_seed(0)
    x, context = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 7, 32)
    t = torch.tensor([10, 500])

    def grads(model: nn.Module) -> Tensor:
        model.zero_grad(set_to_none=True)
        model(x, t, encoder_hidden_states=context).sample.square().mean().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    for step in range(2):
        assert_equal_grads(grads(unet), grads(plain), f"step {step}")
    assert len(report.swapped) == 8
    assert all(m.status == "active" for m in report.modules)
