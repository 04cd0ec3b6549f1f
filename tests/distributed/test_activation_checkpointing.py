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


class Frozen(nn.Module):
    """Frozen blocks; the input arrives positional, by keyword or inside a dict."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(DictBlock() for _ in range(2)).requires_grad_(False)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.how == "positional":
                x = block(x)
            elif self.how == "keyword":
                x = block(x=x)
            else:
                x = block({"hidden": [x]})
        return x


class DictBlock(Block):
    def forward(self, x: Any, scale: float = 1.0) -> torch.Tensor:  # type: ignore[override]
        hidden = x["hidden"][0] if isinstance(x, dict) else x
        return super().forward(hidden, scale)


@pytest.mark.parametrize("how", ["positional", "keyword", "dict"])
def test_a_frozen_block_is_checkpointed_only_where_a_gradient_passes(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen block on an input that needs no gradient runs as it is (nothing to keep);
    on one that does (a trainable layer before it), wherever the input sits in the call,
    it is checkpointed: its activations would be kept for backward otherwise."""
    from lightning_speedkit.distributed import activation_checkpointing as module

    calls = []
    real = module.checkpoint
    monkeypatch.setattr(module, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = Frozen(how)
    assert checkpoint_blocks(model, blocks=["DictBlock"]) == ["blocks.0", "blocks.1"]
    x = torch.randn(2, 4, 64)
    model(x)
    assert calls == []
    model(x.requires_grad_()).sum().backward()
    assert len(calls) == 2


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


def _fit(task: L.LightningModule, callback: ActivationCheckpointing) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )  # fmt: skip
    trainer.fit(task, DataLoader(TensorDataset(torch.randn(4, 3, 64)), batch_size=2))


class _Deep(_Task):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net(depth=4)


def test_a_later_fit_with_other_settings_checkpoints_its_own_choice() -> None:
    """A second fit of the same module (another Trainer and callback) with other
    ``blocks`` or ``fraction`` kept the first fit's blocks, silently."""
    from lightning_speedkit import _surgery

    task = _Deep()
    _fit(task, ActivationCheckpointing(verbose=False))
    every = [f"net.blocks.{i}" for i in range(4)]
    assert checkpointed_blocks(task) == every  # the fit's teardown leaves them checkpointed

    callback = ActivationCheckpointing(fraction=0.5, verbose=False)
    _fit(task, callback)
    assert callback.checkpointed == checkpointed_blocks(task) == ["net.blocks.0", "net.blocks.2"]
    callback = ActivationCheckpointing(blocks=["Block"], fraction=0.25, verbose=False)
    _fit(task, callback)
    assert callback.checkpointed == checkpointed_blocks(task) == ["net.blocks.0"]

    # the same choice again (a new callback with the same settings): left as it is
    forward = _surgery.wrapper(task.net.blocks[0])
    again = ActivationCheckpointing(blocks=["Block"], fraction=0.25, verbose=False)
    _fit(task, again)
    assert again.checkpointed == ["net.blocks.0"]
    assert _surgery.wrapper(task.net.blocks[0]) is forward

    # the blocks re-wrapped compute what the unwrapped model does, and each is wrapped once
    plain = Net(depth=4)
    plain.load_state_dict(task.net.state_dict())
    x = torch.randn(2, 3, 64)
    (loss, grads), (plain_loss, plain_grads) = loss_and_grads(task.net, x), loss_and_grads(plain, x)
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
    for got, want in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert uncheckpoint_blocks(task) == ["net.blocks.0"]
    assert checkpointed_blocks(task) == []


def test_a_later_fit_says_what_it_restored(caplog: pytest.LogCaptureFixture) -> None:
    task = _Deep()
    checkpoint_blocks(task, fraction=0.25)  # by hand, before the fit: another choice
    with caplog.at_level("INFO"):
        _fit(task, ActivationCheckpointing())
    assert "restored 1 block(s) checkpointed before with another choice" in caplog.text
    assert "4 blocks (Block) recompute their activations in backward" in caplog.text
    assert checkpointed_blocks(task) == [f"net.blocks.{i}" for i in range(4)]


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


@pytest.mark.parametrize(
    "function", [checkpoint_blocks, checkpointed_blocks, uncheckpoint_blocks],
    ids=lambda function: function.__name__,
)  # fmt: skip
def test_a_model_that_is_not_a_module_is_refused_with_the_fix(function: Any) -> None:
    """A string (a model's name, say) raised a bare ``AttributeError`` deep inside."""
    name = function.__name__
    with pytest.raises(SpeedkitConfigError) as error:
        function("model")
    assert str(error.value) == (
        f"`model` must be a torch.nn.Module, got 'model' (a string); pass the model (or "
        f"LightningModule) itself to `{name}`, not its name or a path."
    )


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


def _tiny_t5(use_cache: bool) -> Any:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=48, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=2, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    config.use_cache = use_cache
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config)


class _Seq2Seq(L.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        source, target = batch
        return self.model(input_ids=source, labels=target).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_t5_with_its_default_cache_trains_like_the_unwrapped_model_without_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """T5's default ``use_cache=True`` stored the cross-attention keys and values in the
    cache in the forward and read them back in the recomputation, which then saved fewer
    tensors: backward failed. The callback turns the cache off for the fit."""
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randint(1, 48, (6, 10), generator=generator),
                         torch.randint(1, 48, (6, 7), generator=generator))  # fmt: skip

    def run(model: nn.Module, callbacks: list[L.Callback]) -> tuple[list[Any], list[Any]]:
        losses: list[torch.Tensor] = []
        grads: list[list[torch.Tensor]] = []
        cache_seen: list[bool] = []

        class Trace(L.Callback):
            def on_train_batch_end(self, trainer: L.Trainer, module: Any, out: Any,
                                   *a: Any) -> None:  # fmt: skip
                losses.append(out["loss"].detach().clone())
                cache_seen.append(model.config.use_cache)

            def on_before_optimizer_step(self, trainer: L.Trainer, module: Any,
                                         optimizer: Any) -> None:  # fmt: skip
                grads.append([p.grad.clone() for p in module.parameters() if p.grad is not None])

        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            callbacks=[*callbacks, Trace()],
        )  # fmt: skip
        trainer.fit(_Seq2Seq(model), DataLoader(data, batch_size=2))
        assert cache_seen == [False] * 3
        return losses, grads

    plain_losses, plain_grads = run(_tiny_t5(use_cache=False), [])
    model = _tiny_t5(use_cache=True)
    callback = ActivationCheckpointing()
    with caplog.at_level("INFO"):
        losses, grads = run(model, [callback])
    assert callback.checkpointed  # the encoder's and the decoder's T5Block layers
    assert model.config.use_cache is True  # back on after the fit
    assert "`config.use_cache` off for the fit" in caplog.text
    assert len(losses) == len(plain_losses) == 3
    for loss, plain_loss in zip(losses, plain_losses, strict=True):
        assert torch.equal(loss, plain_loss)
    for step, plain_step in zip(grads, plain_grads, strict=True):
        assert len(step) == len(plain_step)
        assert all(torch.equal(g, h) for g, h in zip(step, plain_step, strict=True))


def test_the_cache_is_turned_back_on_when_the_fit_fails() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    class Failing(_Seq2Seq):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            assert self.model.config.use_cache is False
            raise RuntimeError("boom")

    model = _tiny_t5(use_cache=True)
    data = TensorDataset(torch.randint(1, 48, (2, 5)), torch.randint(1, 48, (2, 4)))
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ActivationCheckpointing(verbose=False)],
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Failing(model), DataLoader(data, batch_size=2))
    assert model.config.use_cache is True


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: conv-bn-relu-conv-bn, plus the input."""

    def __init__(self, channels: int, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels, momentum=momentum)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn1(self.conv1(x)).relu()
        return (self.bn2(self.conv2(out)) + x).relu()


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        # momentum=None: a cumulative average, which num_batches_tracked steers
        self.layers = nn.Sequential(BasicBlock(8), BasicBlock(8, momentum=None), BasicBlock(8))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


def test_batch_norm_statistics_are_updated_once_per_step() -> None:
    """The recomputation in backward runs batch norm's forward again in train mode: its
    running statistics took the momentum twice and ``num_batches_tracked`` went up by 2
    per step, so the model in eval mode differed from the unwrapped one."""
    plain, model = ResNet(), ResNet()
    assert checkpoint_blocks(model) == ["layers.0", "layers.1", "layers.2"]
    generator = torch.Generator().manual_seed(1)
    for m in (plain, model):
        m.train()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, model)]
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8, generator=generator)
        for m, optimizer in zip((plain, model), optimizers, strict=True):
            optimizer.zero_grad()
            m(x).square().mean().backward()
            optimizer.step()
    for (name, a), b in zip(plain.named_buffers(), model.buffers(), strict=True):
        assert torch.equal(a, b), name
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert int(model.layers[1].bn1.num_batches_tracked) == 3
    plain.eval()
    model.eval()
    x = torch.randn(2, 3, 8, 8, generator=generator)
    assert torch.equal(plain(x), model(x))


class _MaskedBlock(nn.Module):
    """A conv block with batch norm and a large constant buffer, as a decoder's causal mask."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("mask", torch.tril(torch.ones(64, 64)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bn(self.conv(x)) * self.mask[: x.shape[-2], : x.shape[-1]]


def test_only_running_statistics_are_copied_around_the_recomputation() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func is torch.ops.aten.clone.default:
                self.sizes.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = nn.Sequential(_MaskedBlock(), _MaskedBlock())
    assert checkpoint_blocks(model) == ["0", "1"]
    loss = model(torch.randn(2, 4, 8, 8)).square().mean()
    with Copies() as copies:
        loss.backward()  # the recomputation
    # per block: running_mean and running_var (4 channels) and num_batches_tracked; not the mask
    assert sorted(copies.sizes) == [1, 1, 4, 4, 4, 4]
    assert int(model[0].bn.num_batches_tracked) == 1


def test_the_models_own_checkpointing_on_too_is_warned_about() -> None:
    """transformers' ``gradient_checkpointing_enable()`` flags each decoder layer: the kit
    checkpointing them as well recomputes each twice in backward (exact, but a second
    forward of every layer for nothing). Said once, naming both switches."""
    pytest.importorskip("transformers")
    from tests.helpers.hf_tiny import tiny_model

    build = tiny_model("LlamaConfig", "LlamaForCausalLM", vocab_size=64, hidden_size=32,
                       intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2)  # fmt: skip
    model = build()
    model.gradient_checkpointing_enable()
    with pytest.warns(UserWarning, match=r"own gradient checkpointing is on too .* 2 of its "
                      r"block\(s\) \(`model.layers.0`, `model.layers.1`\).*gradient_checkpointing_"
                      r"disable\(\)"):  # fmt: skip
        assert checkpoint_blocks(model) == ["model.layers.0", "model.layers.1"]


def test_a_parent_flag_diffusers_style_is_seen_and_no_flag_is_silent(
    recwarn: pytest.WarningsRecorder,
) -> None:
    """diffusers sets ``gradient_checkpointing = True`` on the module that checkpoints its
    children (a UNet's down block around its resnets)."""
    net = Net()
    assert checkpoint_blocks(net)
    assert not [w for w in recwarn if "own gradient" in str(w.message)]
    uncheckpoint_blocks(net)
    net.gradient_checkpointing = True  # type: ignore[assignment]
    with pytest.warns(UserWarning, match=r"`gradient_checkpointing = True` on the model\)"):
        checkpoint_blocks(net)
