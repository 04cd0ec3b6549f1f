"""ActivationCheckpointing: same numbers, less saved memory, names and keys unchanged."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_speedkit import ActivationCheckpointing, SpeedkitConfigError
from lightning_speedkit.distributed import (
    checkpoint_blocks,
    checkpointed_blocks,
    saved_tensor_bytes,
    uncheckpoint_blocks,
)


class Block(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1),
                                nn.Linear(4 * dim, dim))  # fmt: skip

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.ff(self.norm(x))


class Net(nn.Module):
    def __init__(self, depth: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale=0.5)
        return self.head(x).mean()


def loss_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(1)  # the same dropout masks
    model.zero_grad()
    loss = model(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    return saved_tensor_bytes(model, x)


def test_outputs_gradients_and_keys_unchanged() -> None:
    plain, wrapped = Net(), Net()
    names = checkpoint_blocks(wrapped)
    assert names == [f"blocks.{i}" for i in range(6)]
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    x = torch.randn(8, 32, 64, requires_grad=False)
    loss, grads = loss_and_grads(plain, x)
    loss_ckpt, grads_ckpt = loss_and_grads(wrapped, x)
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=0)
    for got, want in zip(grads_ckpt, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_saved_activations_really_shrink() -> None:
    plain, wrapped = Net(), Net()
    checkpoint_blocks(wrapped)
    x = torch.randn(8, 128, 64)
    before, after = saved_bytes(plain, x), saved_bytes(wrapped, x)
    # each block now keeps its input (8 x 128 x 64 floats) instead of ~14 tensors of that size
    assert after < before / 5
    half = Net()
    checkpoint_blocks(half, fraction=0.5)
    assert after < saved_bytes(half, x) < before


def test_fraction_spreads_over_the_blocks_and_undo() -> None:
    model = Net(depth=6)
    assert checkpoint_blocks(model, fraction=0.5) == ["blocks.0", "blocks.2", "blocks.4"]
    assert uncheckpoint_blocks(model) == ["blocks.0", "blocks.2", "blocks.4"]
    assert checkpoint_blocks(model, blocks=["Block"], fraction=1 / 6) == ["blocks.0"]


def test_eval_and_no_grad_run_the_blocks_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_speedkit.distributed import activation_checkpointing as module

    calls = []
    real = module.checkpoint

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "checkpoint", counting)
    plain, wrapped = Net(), Net()
    checkpoint_blocks(wrapped)
    x = torch.randn(2, 4, 64)
    with torch.no_grad():
        wrapped(x)
    assert calls == []  # nothing to keep for backward: no recomputation set up
    plain.eval()
    wrapped.eval()
    assert saved_bytes(wrapped, x) == saved_bytes(plain, x)  # eval: the blocks as they are
    assert calls == []
    wrapped.train()
    wrapped(x)
    assert len(calls) == 6  # training with gradients: every block checkpointed


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fraction": 0}, "fraction"),
        ({"fraction": 1.5}, "fraction"),
        ({"blocks": "everything"}, '"auto"'),
        ({"blocks": ["Nope"]}, r"not a module class of this model.*repeated blocks are Block"),
        ({"blocks": [nn.Conv2d]}, r"no module class of this model.*repeated blocks are Block"),
        ({"blocks": [3]}, "module classes or names"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(SpeedkitConfigError, match=match):
        checkpoint_blocks(Net(), **kwargs)


@pytest.mark.parametrize(
    ("blocks", "match"),
    [
        ("nonexistent", r"pass a list: `blocks=\['nonexistent'\]`"),
        ([], "names no block"),
        (Block, r"`blocks=\[Block\]`"),
        (["not a name"], "module classes or names"),
        (["no_such_package_xyz.Block"], "cannot be imported"),
        (["torch.nn.functional.relu"], "not an nn.Module class"),
    ],
)
def test_what_needs_no_model_is_refused_at_construction(blocks: Any, match: str) -> None:
    with pytest.raises(SpeedkitConfigError, match=match):
        ActivationCheckpointing(blocks=blocks)


def test_blocks_by_import_path() -> None:
    path = f"{__name__}.Block"
    assert checkpoint_blocks(Net(depth=2), blocks=[path]) == ["blocks.0", "blocks.1"]


def test_checkpointing_twice_wraps_each_block_once() -> None:
    model = Net(depth=2)
    assert checkpoint_blocks(model) == ["blocks.0", "blocks.1"]
    assert checkpoint_blocks(model) == []  # already done: not wrapped a second time
    assert uncheckpoint_blocks(model) == ["blocks.0", "blocks.1"]
    assert checkpointed_blocks(model) == []


class _Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net(depth=2)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_one_callback_serves_two_fits_of_two_models() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    callback = ActivationCheckpointing(verbose=False)
    data = DataLoader(TensorDataset(torch.randn(4, 3, 64)), batch_size=2)
    tasks = [_Task(), _Task()]
    for task in tasks:
        trainer = L.Trainer(
            accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
        )  # fmt: skip
        trainer.fit(task, data)
        assert callback.checkpointed == ["net.blocks.0", "net.blocks.1"]
    for task in tasks:  # the second model too, not only the first
        assert checkpointed_blocks(task) == ["net.blocks.0", "net.blocks.1"]
    trainer.fit(tasks[1], data)  # a later fit of the same model: kept, wrapped once
    assert uncheckpoint_blocks(tasks[1]) == ["net.blocks.0", "net.blocks.1"]
    assert checkpointed_blocks(tasks[1]) == []


def test_callback_trains_the_example_vlm_like_the_plain_run(demo_corpus: Any) -> None:
    from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule, VLMTask

    def run(callbacks: list[L.Callback]) -> list[float]:
        L.seed_everything(0, verbose=False)
        tokenizer = CaptionTokenizer()
        config = VLMConfig.preset("tiny", tokenizer.vocab_size)
        data = VLMDataModule.for_model(config, demo_corpus, batch_size=8)
        task = VLMTask(config, pad_id=tokenizer.pad_id)
        losses: list[float] = []

        class Trace(L.Callback):
            def on_train_batch_end(
                self, trainer: L.Trainer, module: Any, out: Any, *a: Any
            ) -> None:
                losses.append(float(out["loss"]))

        trainer = L.Trainer(
            accelerator="cpu", max_steps=4, logger=False, limit_val_batches=0,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[*callbacks, Trace()],
        )  # fmt: skip
        trainer.fit(task, datamodule=data)
        return losses

    callback = ActivationCheckpointing()
    with_ckpt = run([callback])
    assert len(callback.checkpointed) == 4  # the tiny preset: 2 vision + 2 decoder blocks
    assert with_ckpt == pytest.approx(run([]), rel=1e-6)


def test_wrapped_model_is_refused() -> None:
    class OptimizedModule(nn.Module):  # the name torch.compile's wrapper has
        pass

    with pytest.raises(SpeedkitConfigError, match="already wrapped"):
        checkpoint_blocks(OptimizedModule())


def test_with_swapped_attention_checked_inside_a_checkpointed_block() -> None:
    """AttentionSwap's first-call parity check runs inside the checkpointed block's forward;
    the recomputation must replay the same operations (it failed with "a different number
    of tensors was saved" before the check kept its own saved tensors)."""
    from lightning_speedkit import swap_attention
    from speedkit_examples.vlm import VLM, VLMConfig

    torch.manual_seed(0)
    config = VLMConfig.preset("tiny", vocab_size=35)  # type: ignore[arg-type]
    plain = VLM(config)
    model = VLM(config)
    model.load_state_dict(plain.state_dict())
    swap_attention(model, "sdpa")  # no sample: checked at the first real call
    assert checkpoint_blocks(model)
    images = torch.randn(2, 3, config.image_size, config.image_size)
    ids = torch.randint(0, 35, (2, 12))
    for m in (plain, model):
        m(images, ids).square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
