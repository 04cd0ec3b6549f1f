"""FusedOptimizer: the same optimizer object on fused kernels, same numbers, same checkpoints."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.optim import adam as adam_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import FusedOptimizer
from lightning_speedkit.compute import OptimizerSwitch, _fused_choice, _fused_probe, fuse_optimizers
from lightning_speedkit.errors import SpeedkitConfigError

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
        torch.optim.AdamW(params, foreach=True),
        torch.optim.AdamW([{"params": []}]),
    ])  # fmt: skip
    assert [s.implementation for s in switches] == [None] * 10
    reasons = [s.reason for s in switches]
    assert reasons[0].startswith("torch has no fused RMSprop, and its foreach kernels run on cuda")
    assert reasons[1] == "torch has no fused LBFGS, nor a foreach one"
    assert "MyAdam is not one of torch's optimizers" in reasons[2]
    assert reasons[3] == "`fused=False` was set explicitly: left as chosen"
    assert reasons[4] == "`foreach=False` was set explicitly: left as chosen"
    assert reasons[5].startswith("differentiable=True")
    assert reasons[6] == "already fused (as constructed)"
    assert reasons[7] == "not a torch.optim.Optimizer"
    assert reasons[8] == "`foreach=True` was set explicitly: left as chosen"
    assert reasons[9] == "its parameter groups hold no parameters: nothing to switch"


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


def _low_precision_sgd_is_broken(dtype: torch.dtype) -> bool:
    """Whether this torch's fused CPU SGD leaves a 64-element weight of ``dtype`` unmoved."""
    weight = torch.ones(64, dtype=dtype, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1, fused=True)
    weight.grad = torch.full_like(weight, 2.0)
    optimizer.step()
    return bool((weight.detach() == 1).any())


def _bf16_linears(dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).to(dtype)
    return model, copy.deepcopy(model)


def _train_low_precision(model: nn.Module, optimizer: torch.optim.Optimizer, dtype: Any) -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
        optimizer.step()


def _movements(
    model: nn.Module, plain_model: nn.Module, start: list[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """How far each weight matrix moved from ``start``, in ``model`` and in ``plain_model``."""
    pairs = zip(model.parameters(), plain_model.parameters(), start, strict=True)
    return [
        (p.detach().float() - p0, q.detach().float() - p0) for p, q, p0 in pairs if p.dim() == 2
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_sgd_trains_as_the_plain_one_does(dtype: torch.dtype) -> None:
    # On the CPU, torch's fused SGD does not write the update back to a bf16/fp16 weight of
    # 16 elements or more (its vectorised loop): a 2-element probe passed, training stalled.
    model, plain_model = _bf16_linears(dtype)
    start = [p.detach().float().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9)
    (switch,) = fuse_optimizers([optimizer])
    if _low_precision_sgd_is_broken(dtype):  # torch 2.13 on the CPU
        assert switch.implementation is None
        name = str(dtype).removeprefix("torch.")
        assert switch.reason.startswith(
            f"torch's fused SGD does not match the plain step on cpu {name} parameters (it "
            f"moves the weights "
        )
        assert optimizer.param_groups[0]["fused"] is not True
    _train_low_precision(model, optimizer, dtype)
    _train_low_precision(plain_model, plain, dtype)
    for moved, plain_moved in _movements(model, plain_model, start):
        assert float(plain_moved.norm()) > 0.05  # each weight matrix really trains...
        # ...and the switched (or left alone) optimizer moves it as far, to bf16 rounding
        assert float((moved - plain_moved).norm() / plain_moved.norm()) <= 0.05


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("Adam", torch.bfloat16),
        ("AdamW", torch.bfloat16),
        ("Adagrad", torch.bfloat16),
        ("Adagrad", torch.float16),  # (plain fp16 Adam divides by an eps that rounds to 0: NaN)
    ],
)
def test_low_precision_adam_and_adagrad_are_still_fused(name: str, dtype: torch.dtype) -> None:
    model, plain_model = _bf16_linears(dtype)
    start = [p.detach().float().clone() for p in model.parameters()]
    optimizer = OPTIMIZERS[name](model.parameters())
    plain = OPTIMIZERS[name](plain_model.parameters())
    (switch,) = fuse_optimizers([optimizer])
    assert (switch.implementation, switch.reason) == (
        "fused",
        f"torch's fused {name} kernel on cpu",
    )
    _train_low_precision(model, optimizer, dtype)
    _train_low_precision(plain_model, plain, dtype)
    for moved, plain_moved in _movements(model, plain_model, start):
        assert float(plain_moved.norm()) > 0.05
        assert float((moved - plain_moved).norm() / plain_moved.norm()) <= 0.1  # bf16 rounding


def _leaves_big_weights(kernel: Any) -> Any:
    """``kernel``, but weights of 16 elements or more keep their value: the CPU SGD bug."""

    def broken(params: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        before = [p.detach().clone() for p in params]
        kernel(params, *args, **kwargs)
        with torch.no_grad():
            for p, b in zip(params, before, strict=True):
                if p.numel() >= 16:
                    p.copy_(b)

    return broken


def _forgets_momentum(kernel: Any) -> Any:
    """``kernel``, but the last probe step halves Adam's exp_avg: right weights, wrong state."""
    calls = [0]

    def broken(
        params: list[torch.Tensor], grads: Any, exp_avgs: Any, *args: Any, **kw: Any
    ) -> None:
        kernel(params, grads, exp_avgs, *args, **kw)
        calls[0] += 1
        if calls[0] % _fused_probe._PROBE_STEPS == 0:
            with torch.no_grad():
                for exp_avg in exp_avgs:
                    exp_avg.mul_(0.5)

    return broken


def test_the_probe_compares_weights_and_state_with_the_plain_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    adam = adam_module._fused_adam
    monkeypatch.setattr(adam_module, "_fused_adam", _leaves_big_weights(adam))
    (switch,) = fuse_optimizers([torch.optim.Adam(_model().parameters())])
    assert switch.implementation is None
    assert switch.reason.startswith(
        "torch's fused Adam does not match the plain step on cpu float32 parameters (it moves "
        "the weights 0% as far as the plain step)"
    )
    monkeypatch.setattr(adam_module, "_fused_adam", _forgets_momentum(adam))
    (switch,) = fuse_optimizers([torch.optim.Adam(_model().parameters())])
    assert switch.implementation is None
    assert "(its state `exp_avg` lands 50% away from the plain step's)" in switch.reason
    monkeypatch.setattr(adam_module, "_fused_adam", adam)
    assert fuse_optimizers([torch.optim.Adam(_model().parameters())])[0].implementation == "fused"


class _SparseNet(Net):
    """Net, with a sparse-gradient embedding of token ids added to its input."""

    def __init__(self, optimizer: str, bag: bool) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.tokens: nn.Module = (
            nn.EmbeddingBag(10, 16, mode="sum", sparse=True)
            if bag
            else nn.Embedding(10, 16, sparse=True)
        )
        self.optimizer = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x[..., 0].abs() * 5).long().clamp(max=9)  # (batch, tokens)
        added = self.tokens(ids)  # (batch, tokens, 16) or, from the bag, (batch, 16)
        return super().forward(x + (added if added.dim() == 3 else added[:, None]))

    def configure_optimizers(self) -> Any:
        if self.optimizer == "adagrad":
            return torch.optim.Adagrad(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


@pytest.mark.parametrize(
    ("optimizer", "bag"), [("sgd", False), ("adagrad", False), ("sgd", True), ("adagrad", True)]
)
def test_sparse_gradients_leave_the_optimizer_alone(optimizer: str, bag: bool) -> None:
    # torch's fused SGD and Adagrad raise at the first step on a sparse gradient; the plain
    # ones take it. The callback finds the modules that make them in the LightningModule.
    plain_losses, fused_losses = Losses(), Losses()
    plain_model, model = _SparseNet(optimizer, bag), _SparseNet(optimizer, bag)
    trainer(4, [plain_losses]).fit(plain_model, loader())
    callback = FusedOptimizer(verbose=False)
    trainer(4, [callback, fused_losses]).fit(model, loader())  # raised RuntimeError before
    (switch,) = callback.switched
    kind = "EmbeddingBag" if bag else "Embedding"
    assert (switch.implementation, switch.reason) == (None, (
        f"some of its parameters get sparse gradients from `tokens` ({kind} with sparse=True), "
        f"which torch's fused kernels refuse: left as it is"
    ))  # fmt: skip
    assert model.tokens.weight.grad is not None
    assert model.tokens.weight.grad.is_sparse
    assert fused_losses.losses == plain_losses.losses  # the plain optimizer, the same numbers
    assert not torch.equal(model.tokens.weight, _SparseNet(optimizer, bag).tokens.weight)


def test_a_sparse_gradient_already_there_is_seen_without_the_model() -> None:
    embedding = nn.Embedding(10, 4, sparse=True)
    optimizer = torch.optim.SGD(embedding.parameters(), lr=0.1)
    embedding(torch.tensor([1, 2])).sum().backward()
    (switch,) = fuse_optimizers([optimizer])
    assert switch.implementation is None
    assert switch.reason.startswith("some of its parameters get sparse gradients, which")
    before = embedding.weight.detach().clone()
    optimizer.step()
    assert float((embedding.weight - before).abs().sum()) == pytest.approx(0.8)  # 2 rows x 4


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        ("single", "got a SGD object"),
        ("adam", "got 'adam' (a string)"),
        (None, "got None"),
        ({"a": 1}, "got {'a': 1}"),
    ],
)
def test_bad_optimizers_are_refused_by_name(given: Any, shown: str) -> None:
    optimizer = torch.optim.SGD(_model().parameters(), lr=0.1)
    value = optimizer if given == "single" else given
    with pytest.raises(
        SpeedkitConfigError, match=r"^`optimizers` must be a list of optimizers"
    ) as e:
        fuse_optimizers(value)
    assert shown in str(e.value)
    assert "`fuse_optimizers([optimizer])`" in str(e.value)
    assert optimizer.param_groups[0]["fused"] is None  # nothing was switched
    with pytest.raises(SpeedkitConfigError, match=r"^`model` must be a torch\.nn\.Module"):
        fuse_optimizers([optimizer], model="net")  # type: ignore[arg-type]


def test_an_added_group_that_fails_the_probe_stays_unswitched_with_a_warning() -> None:
    # A group added later is probed like the first ones before it is switched (here at a
    # load, before any step). This one holds bf16 weights, which torch's fused CPU SGD
    # would leave where they were: it stays plain, and the warning names it.
    if not _low_precision_sgd_is_broken(torch.bfloat16):
        pytest.skip("this torch's fused CPU SGD handles bf16 weights: nothing to refuse")
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert fuse_optimizers([optimizer])[0].implementation == "fused"
    late = nn.Sequential(nn.Linear(8, 32)).to(torch.bfloat16)
    optimizer.add_param_group({"params": late.parameters()})
    with pytest.warns(UserWarning, match=(
        r"parameter group 1 \(2 parameters\) of SGD, added after the switch to fused, runs "
        r"as it was added, unswitched: torch's fused SGD does not match the plain step on "
        r"cpu bfloat16 parameters"
    )):  # fmt: skip
        optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert optimizer.param_groups[0]["fused"] is True  # the probed group is switched again
    assert optimizer.param_groups[1]["fused"] is not True
    (again,) = fuse_optimizers([optimizer], model=late)  # seen once: no second warning
    assert again.reason.startswith(
        "switched to fused before; group 1 (2 parameters: 0.weight, 0.bias), added since, left "
        "as it was: torch's fused SGD does not match the plain step"
    )
    assert optimizer.param_groups[1]["fused"] is not True
    before = late[0].weight.detach().float().clone()
    late(torch.ones(4, 8, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    assert float((late[0].weight.detach().float() - before).abs().min()) > 0.1  # all moved
    assert optimizer.state_dict()["param_groups"][1]["fused"] is None


def test_an_added_group_is_switched_before_its_first_step() -> None:
    model, twin = _model(), _model()
    optimizer = torch.optim.Adam(model[0].parameters(), lr=1e-2)
    plain = torch.optim.Adam(twin[0].parameters(), lr=1e-2)
    fuse_optimizers([optimizer])
    _train(model, optimizer, 2)
    _train(twin, plain, 2)
    optimizer.add_param_group({"params": model[2].parameters(), "lr": 1e-3})
    plain.add_param_group({"params": twin[2].parameters(), "lr": 1e-3})
    with _Operators() as ops:
        _train(model, optimizer, 3, seed=4)
    _train(twin, plain, 3, seed=4)
    assert [group["fused"] for group in optimizer.param_groups] == [True, True]
    # one fused call per group and step (the added group runs on the kernel too), plus the
    # added group's probe before its first step
    assert ops.names.count("_fused_adam_.default") == 2 * 3 + _fused_probe._PROBE_STEPS
    assert optimizer.state_dict()["param_groups"] == plain.state_dict()["param_groups"]
    _close(model, twin)
    (again,) = fuse_optimizers([optimizer])
    assert again.reason == "switched to fused before; group(s) 1 added since switched too"


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


class _Finetuned(L.LightningModule):
    """A backbone that Lightning's BackboneFinetuning unfreezes at epoch 1, and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _finetune(callbacks: list[L.Callback], **kwargs: Any) -> tuple[nn.Module, L.Trainer]:
    from lightning.pytorch.callbacks import BackboneFinetuning

    g = torch.Generator().manual_seed(2)
    data = DataLoader(TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1,
                                                                            generator=g)),
                      batch_size=8)  # fmt: skip
    model = _Finetuned()
    ckpt_path = kwargs.pop("ckpt_path", None)
    options = {"max_epochs": 3, **kwargs}
    run = trainer(-1, [BackboneFinetuning(unfreeze_backbone_at_epoch=1), *callbacks], **options)
    run.fit(model, data, ckpt_path=ckpt_path)
    return model, run


def test_an_added_group_gets_foreach_where_the_switch_chose_foreach(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # RMSprop has no fused kernel: on an accelerator the switch chooses foreach. torch's
    # foreach ops also run on the CPU (one loop per tensor), standing in for one here.
    monkeypatch.setattr(_fused_choice._compat, "foreach_kernel_devices", lambda: ["cpu"])
    model, twin = _model(), _model()
    optimizer = torch.optim.RMSprop(model[0].parameters(), lr=1e-2)
    plain = torch.optim.RMSprop(twin[0].parameters(), lr=1e-2)
    assert fuse_optimizers([optimizer])[0].implementation == "foreach"
    optimizer.add_param_group({"params": model[2].parameters()})
    plain.add_param_group({"params": twin[2].parameters()})
    _train(model, optimizer, 3)
    _train(twin, plain, 3)
    assert [g["foreach"] for g in optimizer.param_groups] == [True, True]
    assert optimizer.state_dict()["param_groups"] == plain.state_dict()["param_groups"]
    _close(model, twin)


def test_a_group_added_by_backbone_finetuning_is_switched_too() -> None:
    plain_model, plain_run = _finetune([])
    model, run = _finetune([FusedOptimizer(verbose=False)])
    optimizer = run.optimizers[0]
    assert len(optimizer.param_groups) == len(plain_run.optimizers[0].param_groups) == 2
    # the backbone's group, added at epoch 1, runs the same kernel as the head's
    assert [group["fused"] for group in optimizer.param_groups] == [True, True]
    assert optimizer.param_groups[1]["lr"] == plain_run.optimizers[0].param_groups[1]["lr"]
    assert all(group["fused"] is None for group in optimizer.state_dict()["param_groups"])
    assert not torch.equal(model.backbone[0].weight, _Finetuned().backbone[0].weight)  # trained
    _close(model, plain_model)


def test_a_backbone_finetuning_checkpoint_is_the_plain_runs_and_resumes_switched(
    tmp_path: Any,
) -> None:
    """BackboneFinetuning saves the live parameter groups in its own callback state, with
    the flags the switch wrote (``fused=True, foreach=False``), and puts them back when fit
    starts. Listed before FusedOptimizer, it made the resumed run's groups look chosen by
    hand (``foreach=False``): the run resumed unswitched."""
    _, first = _finetune([FusedOptimizer(verbose=False)], max_epochs=2)
    path = tmp_path / "epoch1.ckpt"
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    # the optimizer's state is the plain run's: both groups, the added one included
    flags = [(g["fused"], g["foreach"]) for g in saved["optimizer_states"][0]["param_groups"]]
    assert flags == [(None, None), (None, None)]

    # into a run without the callback: it stays plain
    plain_model, plain = _finetune([], max_epochs=3, ckpt_path=path)
    assert [g["fused"] for g in plain.optimizers[0].param_groups] == [None, None]
    # with it, after BackboneFinetuning (which puts its groups back first): switched, and
    # training goes on as the plain run resumed from it does
    callback = FusedOptimizer(verbose=False)
    resumed_model, resumed = _finetune([callback], max_epochs=3, ckpt_path=path)
    assert [s.implementation for s in callback.switched] == ["fused"]
    assert [g["fused"] for g in resumed.optimizers[0].param_groups] == [True, True]
    _close(resumed_model, plain_model)
