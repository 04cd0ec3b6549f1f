"""A checkpointed block's buffers and counters end each step as without checkpointing.

The recomputation in backward runs the block's forward again: a counter, an MoE
expert-load buffer or a reassigned running mean it updates took every update twice, and
the recomputation ran on the values the forward had left, so a forward whose output
reads such a buffer gave other gradients. Losses were identical, so nothing showed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import ActivationCheckpointing
from lightning_speedkit.distributed import _replayed_state, checkpoint_blocks


class Counting(nn.Module):
    """Updates, in its forward, a buffer in place, a reassigned buffer and a plain counter,
    and its output reads each of them before the update."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("mask", torch.tril(torch.ones(64, 64)))  # constant
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = (1 + 0.5 * self.calls.float()) * (1 + 0.25 * self.seen)
        y = x + self.lin(x) * scale + self.running_mean * self.mask[0, 0]
        if self.training:
            self.calls += 1
            self.running_mean = 0.9 * self.running_mean + 0.1 * x.detach().mean(0)
            self.seen += 1
        return y


class Load(nn.Module):
    """An MoE router's expert load: a buffer changed in place through a nested module."""

    def __init__(self, dim: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.register_buffer("load", torch.zeros(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self.router(x).softmax(-1)
        out = x * (gates.max(-1).values[:, None] + self.load.sum())
        if self.training:
            self.load += torch.bincount(gates.argmax(-1), minlength=4).float()
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.count = Counting()
        self.moe = Load()
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.moe(self.count(x)))


class Net(nn.Module):
    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Shared(nn.Module):
    """ALBERT: one block called several times per step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.layer(x)
        return x


def train(model: nn.Module, steps: int = 3) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Losses and gradients of ``steps`` SGD steps on the same batches."""
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(6, 8, generator=generator)).square().mean()
        loss.backward()
        losses.append(loss.detach())
        grads += [p.grad.clone() for p in model.parameters()]
        optimizer.step()
    return losses, grads


def assert_same_state(plain: nn.Module, model: nn.Module) -> None:
    for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    counters = [(m.seen, n.seen) for m, n in zip(plain.modules(), model.modules(), strict=True)
                if isinstance(m, Counting)]  # fmt: skip
    assert all(a == b for a, b in counters), counters


@pytest.mark.parametrize("make", [Net, Shared], ids=["blocks", "one-block-called-3-times"])
def test_buffers_counters_losses_and_gradients_equal_the_plain_run(
    make: Callable[[], nn.Module],
) -> None:
    plain, model = make(), make()
    assert checkpoint_blocks(model, blocks=[Block])
    expected, got = train(plain), train(model)
    for a, b in zip(expected[0] + expected[1], got[0] + got[1], strict=True):
        assert torch.equal(a, b)
    assert_same_state(plain, model)
    counting = model.get_submodule("layer.count" if make is Shared else "blocks.0.count")
    assert int(counting.calls) == counting.seen == (9 if make is Shared else 3)


def test_nested_checkpointed_blocks_keep_their_buffers() -> None:
    plain, model = Net(), Net()
    assert checkpoint_blocks(model, blocks=[Block]) == ["blocks.0", "blocks.1"]
    # a checkpoint inside each checkpoint
    inner = checkpoint_blocks(model, blocks=[Counting, Load])
    assert inner == ["blocks.0.count", "blocks.0.moe", "blocks.1.count", "blocks.1.moe"]
    expected, got = train(plain), train(model)
    for a, b in zip(expected[0] + expected[1], got[0] + got[1], strict=True):
        assert torch.equal(a, b)
    assert_same_state(plain, model)


class _Clones(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.clone.default:
            self.sizes.append(args[0].numel())
        return func(*args, **(kwargs or {}))


def test_only_what_the_forward_changes_in_place_is_copied_after_the_first_step() -> None:
    model = nn.Sequential(Counting(), Counting())
    assert checkpoint_blocks(model) == ["0", "1"]
    model(torch.randn(4, 8)).sum().backward()  # the first call learns what changes
    x = torch.randn(4, 8)
    with _Clones() as clones:
        model(x).sum().backward()
    # per block: ``calls`` before its forward and before the recomputation (its value after
    # the forward, put back after it); the reassigned running mean is kept by reference;
    # the 64 x 64 mask is not copied
    assert sorted(clones.sizes) == [1, 1, 1, 1]
    assert [int(m.calls) for m in model] == [2, 2]


class _Late(nn.Module):
    """Changes its buffer in place only from its second call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("total", torch.zeros(8))
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        if self.steps > 1:
            self.total += x.detach().sum(0)
        return self.lin(x)


def test_a_buffer_first_changed_after_the_first_call_is_updated_once_and_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_replayed_state, "_WARNED", set())  # said once per process
    plain, model = nn.Sequential(_Late(), _Late()), nn.Sequential(_Late(), _Late())
    model.load_state_dict(plain.state_dict())
    checkpoint_blocks(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(plain)
        train(model)
    assert_same_state(plain, model)
    assert [m.steps for m in model] == [3, 3]
    said = [str(w.message) for w in caught if "for the first time" in str(w.message)]
    assert len(said) == 1, said
    assert "['total']" in said[0]


class _LateCounter(nn.Module):
    """A counter gained at its second call and changed from its fourth, which the input of
    its linear layer (a tensor the recomputation recomputes) reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        if self.steps == 2:
            self.late = 0
        elif self.steps > 3:
            self.late += 1
        return self.lin(x * (1 + 0.5 * self.steps + 0.25 * getattr(self, "late", 0))).tanh()


def test_a_counter_gained_and_changed_after_the_first_call_is_replayed_too() -> None:
    plain = nn.Sequential(_LateCounter(), _LateCounter())
    model = nn.Sequential(_LateCounter(), _LateCounter())
    model.load_state_dict(plain.state_dict())
    checkpoint_blocks(model)
    expected, got = train(plain, steps=6), train(model, steps=6)
    for a, b in zip(expected[0] + expected[1], got[0] + got[1], strict=True):
        assert torch.equal(a, b)
    assert [(m.steps, m.late) for m in model] == [(6, 3), (6, 3)]


def test_a_submodule_swapped_after_the_first_step_has_its_buffers_kept() -> None:
    plain, model = Net(), Net()
    checkpoint_blocks(model, blocks=[Block])
    replaced = []  # alive, as a module kept elsewhere would be
    for net in (plain, model):
        train(net, steps=1)
        torch.manual_seed(3)
        replaced.append(net.blocks[0].count)
        net.blocks[0].count = Counting()  # its buffers are new to the block's first call
    expected, got = train(plain), train(model)
    for a, b in zip(expected[0] + expected[1], got[0] + got[1], strict=True):
        assert torch.equal(a, b)
    assert_same_state(plain, model)


class Sliced(Net):
    """transformers' Llama and Qwen2 loop over ``self.layers[:n]``: a new ``nn.ModuleList``
    each forward, whose registrations are in no block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks[: len(self.blocks)]:
            x = block(x)
        return x


@pytest.mark.parametrize("model_type", [Net, Sliced])
def test_after_the_first_step_no_call_walks_its_block_or_scans_attributes(
    monkeypatch: pytest.MonkeyPatch, model_type: type[Net]
) -> None:
    """What a call keeps is learned once: later calls read the slots and counter names
    learned then, and do not walk the block's modules and buffers or scan their
    attributes for counters, which cost ~100 us per call for a transformer layer."""
    walks, scans = [0], [0]
    named_buffers, counter_names = nn.Module.named_buffers, _replayed_state._counter_names

    def counted_buffers(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        walks[0] += 1
        return named_buffers(self, *args, **kwargs)

    def counted_names(attrs: dict[str, Any]) -> Any:
        scans[0] += 1
        return counter_names(attrs)

    monkeypatch.setattr(nn.Module, "named_buffers", counted_buffers)
    monkeypatch.setattr(_replayed_state, "_counter_names", counted_names)
    model = model_type()
    checkpoint_blocks(model, blocks=[Block])
    train(model, steps=1)
    assert walks[0] > 0  # learned at the first step
    assert scans[0] > 0
    walks[0] = scans[0] = 0
    train(model, steps=2)
    assert (walks[0], scans[0]) == (0, 0)
    assert int(model.blocks[0].count.calls) == model.blocks[0].count.seen == 3


class _Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def test_the_callback_trains_like_the_plain_run() -> None:
    torch.manual_seed(2)
    data = DataLoader(TensorDataset(torch.randn(24, 8)), batch_size=6)
    modules = []
    for callbacks in ([], [ActivationCheckpointing(blocks=["Block"], verbose=False)]):
        module = _Module()
        trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, callbacks=callbacks,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)  # fmt: skip
        trainer.fit(module, data)
        modules.append(module)
    plain, model = modules
    assert_same_state(plain, model)
    assert int(model.net.blocks[1].count.calls) == 4
