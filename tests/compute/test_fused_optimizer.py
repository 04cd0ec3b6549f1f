"""FusedOptimizer: the same optimizer object on fused kernels, same numbers, same checkpoints."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_speedkit import FusedOptimizer
from lightning_speedkit.compute import OptimizerSwitch, fuse_optimizers

from .models import Losses, Net, loader, trainer

RTOL = 1e-5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


class _Operators(TorchDispatchMode):
    """The ATen operators that ran inside."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func).split("aten.")[-1])
        return func(*args, **(kwargs or {}))


def _close(a: nn.Module, b: nn.Module, rtol: float = RTOL) -> float:
    """Largest relative difference of a parameter tensor: ||a - b|| / ||b||."""
    worst = 0.0
    with torch.no_grad():
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            worst = max(worst, float((p - q).norm() / q.norm().clamp_min(1e-12)))
    assert worst <= rtol
    return worst


OPTIMIZERS = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_on_cpu_matches_the_plain_optimizer(name: str) -> None:
    plain_model, fused_model = _model(), _model()
    plain = OPTIMIZERS[name](plain_model.parameters())
    fused = OPTIMIZERS[name](fused_model.parameters())
    _train(plain_model, plain, 2)
    _train(fused_model, fused, 2)  # state exists before the switch: it carries on
    (switch,) = fuse_optimizers([fused])
    assert switch == OptimizerSwitch(0, name, "fused", f"torch's fused {name} kernel on cpu")
    assert all(group["fused"] is True for group in fused.param_groups)
    with _Operators() as plain_ops:
        _train(plain_model, plain, 5, seed=4)
    with _Operators() as fused_ops:
        _train(fused_model, fused, 5, seed=4)
    _close(fused_model, plain_model)
    # the fused kernel really ran (one call per step), and the plain optimizer has none
    assert fused_ops.names.count(f"_fused_{name.lower()}_.default") == 5
    assert not any("_fused_" in op for op in plain_ops.names)


def test_what_is_left_alone_and_why() -> None:
    params = list(_model().parameters())

    class MyAdam(torch.optim.Adam):
        pass

    switches = fuse_optimizers([
        torch.optim.RMSprop(params),  # no fused kernel; foreach kernels are not on CPU
        torch.optim.LBFGS(params),
        MyAdam(params),
        torch.optim.AdamW(params, fused=False),
        torch.optim.Adam(params, foreach=False),
        torch.optim.Adam(params, differentiable=True),
        torch.optim.Adam(params, fused=True),
        "not an optimizer",
    ])  # fmt: skip
    assert [s.implementation for s in switches] == [None] * 8
    reasons = [s.reason for s in switches]
    assert reasons[0].startswith("torch has no fused RMSprop, and its foreach kernels run on cuda")
    assert reasons[1] == "torch has no fused LBFGS, nor a foreach one"
    assert "MyAdam is not one of torch's optimizers" in reasons[2]
    assert reasons[3] == "`fused=False` was set explicitly: left as chosen"
    assert reasons[4] == "`foreach=False` was set explicitly: left as chosen"
    assert reasons[5].startswith("differentiable=True")
    assert reasons[6] == "already fused (as constructed)"
    assert reasons[7] == "not a torch.optim.Optimizer"


def test_checkpoints_are_the_plain_optimizers_and_load_either_way() -> None:
    model, twin = _model(), _model()
    fused = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    fuse_optimizers([fused])
    _train(model, fused, 3)
    _train(twin, plain, 3)
    # as a checkpoint holds them: copies, not the live tensors
    saved, plain_saved = copy.deepcopy(fused.state_dict()), copy.deepcopy(plain.state_dict())
    assert saved["param_groups"] == plain_saved["param_groups"]  # fused/foreach as constructed
    assert fused.param_groups[0]["fused"] is True  # the live optimizer is still switched
    for key, state in saved["state"].items():
        assert state["step"].device == plain_saved["state"][key]["step"].device
        torch.testing.assert_close(state["exp_avg"], plain_saved["state"][key]["exp_avg"])

    # into a never-switched optimizer: it stays plain
    loaded_model = copy.deepcopy(model)
    never = torch.optim.AdamW(loaded_model.parameters(), lr=1e-2)
    never.load_state_dict(saved)
    assert never.param_groups[0]["fused"] is None
    # into a switched one (a resumed run): the switch survives the load, and training
    # goes on exactly as the uninterrupted run
    resumed_model = copy.deepcopy(model)
    resumed = torch.optim.AdamW(resumed_model.parameters(), lr=1e-2)
    fuse_optimizers([resumed])
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["fused"] is True
    _train(model, fused, 2, seed=9)
    _train(resumed_model, resumed, 2, seed=9)
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_switching_twice_installs_the_hooks_once() -> None:
    optimizer = torch.optim.Adam(_model().parameters())
    fuse_optimizers([optimizer])
    (again,) = fuse_optimizers([optimizer])
    assert again.implementation == "fused"
    assert again.reason == "switched to fused before"
    assert len(optimizer._optimizer_state_dict_post_hooks) == 1
    assert optimizer.state_dict()["param_groups"][0]["fused"] is None


def test_hugging_face_gpt2_with_fused_adamw_matches_plain() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                     vocab_size=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    plain_model = transformers.GPT2LMHeadModel(config)
    fused_model = copy.deepcopy(plain_model)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    fused = torch.optim.AdamW(fused_model.parameters(), lr=1e-3)
    assert fuse_optimizers([fused])[0].implementation == "fused"
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    losses: list[list[float]] = [[], []]
    for seen, model, optimizer in (
        (losses[0], plain_model, plain),
        (losses[1], fused_model, fused),
    ):
        for _ in range(3):
            optimizer.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            seen.append(float(loss))
    assert losses[1] == pytest.approx(losses[0], rel=RTOL)
    # All weights together. (Tensor by tensor, the key part of c_attn.bias, whose gradient
    # is zero in exact arithmetic, holds Adam's normalised rounding noise: 1e-4 apart.)
    with torch.no_grad():
        flat = [
            torch.cat([p.flatten() for p in m.parameters()]) for m in (fused_model, plain_model)
        ]
        assert float((flat[0] - flat[1]).norm() / flat[1].norm()) <= RTOL


def test_callback_switches_the_trainers_optimizer_in_place() -> None:
    made: list[torch.optim.Optimizer] = []

    class Keep(Net):
        def configure_optimizers(self) -> Any:
            made.append(super().configure_optimizers())
            return made[-1]

    plain_losses, fused_losses = Losses(), Losses()
    trainer(6, [plain_losses]).fit(Net(), loader())
    callback = FusedOptimizer(verbose=False)
    run = trainer(6, [callback, fused_losses])
    run.fit(Keep(), loader())
    assert run.optimizers[0] is made[0]  # no new optimizer object
    assert [s.implementation for s in callback.switched] == ["fused"]
    assert made[0].param_groups[0]["fused"] is True
    assert len(fused_losses.losses) == 6
    for fused_loss, plain_loss in zip(fused_losses.losses, plain_losses.losses, strict=True):
        assert fused_loss == pytest.approx(plain_loss, rel=RTOL)


@pytest.mark.gpu
def test_fused_on_cuda_keeps_step_counts_on_the_device_and_saves_them_on_the_host() -> None:
    model = _model().cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    _train_cuda(model, optimizer)
    assert optimizer.state[next(model.parameters())]["step"].device.type == "cpu"
    (switch,) = fuse_optimizers([optimizer])
    assert switch.implementation == "fused"
    assert optimizer.state[next(model.parameters())]["step"].device.type == "cuda"
    _train_cuda(model, optimizer)
    assert all(s["step"].device.type == "cpu" for s in optimizer.state_dict()["state"].values())


def _train_cuda(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 1, device="cuda")
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
