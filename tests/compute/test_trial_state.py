"""A trial leaves no trace: grads, buffers, modes, counters and random states come back."""

from __future__ import annotations

import random

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit.compute._trial_state import no_logging, preserved


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(3)
        self.seen = 0
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += len(x)
        self.steps = self.steps + 1  # a new tensor: put back by name
        return self.norm(x)


def test_everything_a_trial_touches_is_put_back() -> None:
    model = Counting().eval()
    model.norm.weight.grad = torch.full((3,), 7.0)
    loader = DataLoader(TensorDataset(torch.ones(4, 3)), batch_size=2, shuffle=True,
                        generator=torch.Generator().manual_seed(1))  # fmt: skip
    steps = model.steps
    torch.manual_seed(5)
    random.seed(5)
    want = (torch.rand(1), random.random(), loader.generator.get_state())  # type: ignore[union-attr]
    torch.manual_seed(5)
    random.seed(5)
    with preserved(model, loader):
        assert model.training is True  # trials run in train mode, grads dropped
        assert model.norm.weight.grad is None
        model(torch.randn(4, 3)).sum().backward()
        random.random()
        next(iter(loader))
    assert model.training is False
    assert torch.equal(model.norm.weight.grad, torch.full((3,), 7.0))
    assert torch.equal(model.norm.running_mean, torch.zeros(3))
    assert model.norm.num_batches_tracked.item() == 0
    assert model.steps is steps
    assert model.seen == 0
    assert torch.equal(torch.rand(1), want[0])
    assert random.random() == want[1]
    assert torch.equal(loader.generator.get_state(), want[2])  # type: ignore[union-attr]


def test_self_log_does_nothing_in_a_trial_and_is_the_modules_own_after() -> None:
    import lightning as L

    module = L.LightningModule()
    with no_logging(module):
        assert module.log("loss", 1.0) is None
        assert "log" in module.__dict__
    assert "log" not in module.__dict__
    assert "log_dict" not in module.__dict__


class ClassDefaults(nn.Module):
    seen = 0  # the default on the class: the first `+=` sets it on the module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += len(x)
        self.lazily = [*getattr(self, "lazily", []), len(x)]  # made by the first call
        self._cache = torch.ones(1)  # not a counter: a trial may leave it
        return x


def test_a_counter_a_trial_first_set_on_the_module_goes_again() -> None:
    model = ClassDefaults()
    with preserved(model, DataLoader(TensorDataset(torch.ones(4, 3)), batch_size=2)):
        model(torch.ones(2, 3))
        assert vars(model)["seen"] == 2
    assert "seen" not in vars(model)
    assert model.seen == 0  # the class's again: the trial's samples are not counted
    assert not hasattr(model, "lazily")
    assert torch.equal(model._cache, torch.ones(1))


class LazilyInitialised(nn.Module):
    """torch's own lazy state, made by the first forward (FSDP's root sets `_is_root` and
    `_all_handles` then): not a counter of the user's, and needed by every later call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "_all_handles"):
            self._is_root, self._all_handles = True, []
        return x


def test_private_state_a_trial_first_made_stays() -> None:
    model = LazilyInitialised()
    with preserved(model, DataLoader(TensorDataset(torch.ones(4, 3)), batch_size=2)):
        model(torch.ones(2, 3))
    assert vars(model)["_is_root"] is True
    assert vars(model)["_all_handles"] == []
