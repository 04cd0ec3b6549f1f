"""FusedOptimizer: the optimizers Lightning holds, switched to torch's fused or foreach kernels.

torch's Adam, AdamW, SGD and Adagrad have a fused implementation (one kernel for
every parameter of a device and dtype) on CUDA and, since torch 2.4, on CPU; most
others have a ``foreach`` (multi-tensor) one on accelerators. Which one an optimizer
runs is a flag in each of its parameter groups, read at every ``step()``: switching
sets the flag on the optimizer that exists. No new optimizer object, so the
Trainer, LR schedulers and anything else holding it keep working, and its state
(moments, step counts) carries on.

Checkpoints stay as the unswitched optimizer writes them: a ``state_dict`` hook
puts the groups' original flags (and step counts where the plain optimizer keeps
them, on the CPU) back in what is saved, and a ``load_state_dict`` hook switches
again after a resume loads them. A checkpoint therefore loads into an optimizer
that was never switched, and resumes the same either way.

Each switch is tried first on throwaway parameters of the group's devices and dtypes,
large enough for the kernels' vectorised loops: a few steps with the flag and the
same steps with the plain (single-tensor) implementation, whose parameters and state
must agree within the dtype's rounding. A combination torch refuses, or one it
computes wrongly (on the CPU, fused SGD leaves bf16/fp16 weights of 16 or more
elements where they were), is reported and left alone, not discovered in training.
Optimizers holding parameters that get sparse gradients (an ``nn.Embedding`` or
``nn.EmbeddingBag`` with ``sparse=True``, found in the model when one is given) are
left alone too: the fused kernels refuse sparse gradients.

A parameter group added after the switch (``add_param_group``, as Lightning's
``BackboneFinetuning`` does when it unfreezes the backbone) is given the same flag before
the next ``step()``, after the same probe of its own devices and dtypes; one that fails it
stays as it was added, with a warning that names it.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_speedkit import _compat, _validation

__all__ = ["FusedOptimizer", "OptimizerSwitch", "fuse_optimizers"]

log = logging.getLogger(__name__)

Implementation = Literal["fused", "foreach"]
_MARK = "_speedkit_fused"  # attribute on a switched optimizer: its _Switch record
# The probe: big enough that every element-wise kernel runs its vectorised loop (CPU
# vectors hold 8 to 64 elements) and a scalar tail (the size is prime), a few steps so
# that state created at the first step (momentum buffers) is read and updated after.
_PROBE_NUMEL = 1031
_PROBE_STEPS = 3
_PROBE_LR = 0.1  # moves a probe weight of about 1 by many units of bf16 rounding per step


@dataclass(frozen=True)
class OptimizerSwitch:
    """What :func:`fuse_optimizers` did to one optimizer."""

    index: int
    """Position in the list given (Lightning's ``trainer.optimizers``)."""
    optimizer: str
    """Class name of the torch optimizer (inside any wrapper)."""
    implementation: Implementation | None
    """``"fused"``, ``"foreach"``, or None when left as it was."""
    reason: str
    """Why this implementation, or why none."""

    @property
    def switched(self) -> bool:
        return self.implementation is not None


@dataclass
class _Switch:
    """What the switch did to one optimizer, kept on it (as ``_MARK``) for its hooks."""

    implementation: Implementation
    original: list[dict[str, Any]]
    """Each group seen, in order: its fused/foreach flags before the switch."""
    switched_at_start: int
    """How many groups the first switch found (the rest were added later)."""
    left: dict[int, str] = field(default_factory=dict)
    """Groups seen but left as they were (added later): index -> why."""
    model: weakref.ReferenceType[nn.Module] | None = None
    """The model the optimizer trains, where given: names parameters, finds sparse ones."""

    def switched(self) -> list[int]:
        return [i for i in range(len(self.original)) if i not in self.left]


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside wrappers (Lightning's, DeepSpeed's ZeRO), or None."""
    for _ in range(4):
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def _devices_and_dtypes(group: dict[str, Any]) -> list[tuple[torch.device, torch.dtype]]:
    return list(dict.fromkeys((p.device, p.dtype) for p in group["params"]))


def _tolerance(dtype: torch.dtype) -> float:
    """How far apart (relative, in norm) two correct implementations may land after the probe.

    Rounding differs in low precision: 16 units of rounding (0.125 in bfloat16, 0.016 in
    float16; fused and plain Adam measure 0.03 and 0.004 apart), never below 1e-4.
    """
    eps = torch.finfo(dtype).eps if dtype.is_floating_point or dtype.is_complex else 0.0
    return max(16 * eps, 1e-4)


def _probe_values(count: int, generator: torch.Generator) -> torch.Tensor:
    """Magnitudes in [0.5, 1.5) with random signs: no rounding to zero, no overflow in fp16."""
    sign = torch.randint(0, 2, (count,), generator=generator) * 2 - 1
    return (torch.rand(count, generator=generator) + 0.5) * sign


def _run_probe(
    cls: type[torch.optim.Optimizer],
    options: dict[str, Any],
    places: list[tuple[torch.device, torch.dtype]],
) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
    """Per probe weight: before and after ``_PROBE_STEPS`` steps, and its state (same data)."""
    generator = torch.Generator().manual_seed(0)
    starts = [_probe_values(_PROBE_NUMEL, generator).to(device=d, dtype=t) for d, t in places]
    grads = [[_probe_values(_PROBE_NUMEL, generator).to(device=d, dtype=t) for d, t in places]
             for _ in range(_PROBE_STEPS)]  # fmt: skip
    params = [start.clone().requires_grad_() for start in starts]
    optimizer = cls(params, **options)
    for step_grads in grads:
        for param, grad in zip(params, step_grads, strict=True):
            param.grad = grad.clone()
        optimizer.step()
    return [(s, p.detach(), dict(optimizer.state[p])) for s, p in zip(starts, params, strict=True)]


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """On the CPU in float32 (complex64 for complex), to compare across devices and dtypes."""
    return tensor.detach().cpu().to(torch.complex64 if tensor.is_complex() else torch.float32)


def _distance(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> float:
    """``||got - want|| / scale``; NaN where either holds a NaN."""
    return float((_wide(got) - _wide(want)).norm() / scale.clamp_min(1e-12))


def _disagreement(
    plain: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]],
    tried: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]],
) -> str | None:
    """Where the tried implementation's probe parted from the plain one's; None if nowhere."""
    for (start, want, want_state), (_, got, got_state) in zip(plain, tried, strict=True):
        tolerance = _tolerance(start.dtype)
        where = f"on {start.device.type} {str(start.dtype).removeprefix('torch.')} parameters"
        update = (_wide(want) - _wide(start)).norm()
        off = _distance(got, want, update)
        if not off <= tolerance:  # NaN counts as off
            moved = _distance(got, start, update)
            if moved < 0.5:
                return f"{where} (it moves the weights {moved:.0%} as far as the plain step)"
            return f"{where} (its weights land {off:.0%} of the update away from the plain step's)"
        for key, expected in want_state.items():
            found = got_state.get(key)
            if not isinstance(expected, torch.Tensor) or not isinstance(found, torch.Tensor):
                if (
                    isinstance(expected, torch.Tensor)
                    or isinstance(found, torch.Tensor)
                    or (found != expected)
                ):
                    return (
                        f"{where} (its state `{key}` is {found!r}, the plain step's {expected!r})"
                    )
                continue
            if found.shape != expected.shape:
                return f"{where} (its state `{key}` has another shape than the plain step's)"
            off = _distance(found, expected, _wide(expected).norm())
            if not off <= tolerance:
                return f"{where} (its state `{key}` lands {off:.0%} away from the plain step's)"
    return None


def _probe(
    cls: type[torch.optim.Optimizer], group: dict[str, Any], flag: Implementation
) -> str | None:
    """Why ``flag=True`` cannot run ``group`` as the plain optimizer does; None if it can.

    Throwaway weights, one per device and dtype of the group's parameters, take the same
    steps with the flag and with the plain single-tensor implementation, with the
    group's hyperparameters (but a learning rate that moves them well past rounding):
    the flag's weights and state must land where the plain ones do. The reason reads
    after "torch's fused Adam".
    """
    places = _devices_and_dtypes(group)
    if not places:
        return None
    accepted = inspect.signature(cls.__init__).parameters
    options = {k: v for k, v in group.items() if k in accepted and k not in ("params", "foreach",
                                                                            "fused")}  # fmt: skip
    if "lr" in options:
        lr = options["lr"]
        options["lr"] = (
            torch.full_like(lr, _PROBE_LR) if isinstance(lr, torch.Tensor) else _PROBE_LR
        )
    reference = dict(options, foreach=False) if "foreach" in accepted else dict(options)
    try:
        plain = _run_probe(cls, reference, places)
    except Exception as exc:  # the plain step cannot run these options on these devices either
        return f"could not be checked: the plain step fails on a probe too ({_error(exc)})"
    try:
        tried = _run_probe(cls, dict(options, **{flag: True}), places)
    except Exception as exc:  # torch refuses unsupported combinations with several error types
        return f"refused these parameters ({_error(exc)})"
    why = _disagreement(plain, tried)
    return None if why is None else f"does not match the plain step {why}"


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _sparse_gradient_parameters(model: nn.Module | None) -> dict[int, str]:
    """id of each parameter of ``model`` getting sparse gradients -> the module that makes them."""
    found: dict[int, str] = {}
    for name, module in model.named_modules() if model is not None else ():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse is True:
            found[id(module.weight)] = f"`{name or type(module).__name__}` " \
                                       f"({type(module).__name__} with sparse=True)"  # fmt: skip
    return found


def _choose(
    optimizer: torch.optim.Optimizer, sparse: Mapping[int, str]
) -> tuple[Implementation | None, str]:
    cls = type(optimizer)
    name = cls.__name__
    if not cls.__module__.startswith("torch.optim"):
        return None, (
            f"{name} is not one of torch's optimizers (a subclass or another library's); its "
            f"step may not read the fused/foreach flags"
        )
    groups = optimizer.param_groups
    if all(group.get("fused") for group in groups):
        return None, "already fused (as constructed)"
    for flag in ("fused", "foreach"):
        if any(group.get(flag) is False for group in groups):
            return None, f"`{flag}=False` was set explicitly: left as chosen"
    if any(group.get("foreach") is True for group in groups):
        return None, "`foreach=True` was set explicitly: left as chosen"
    if any(group.get("differentiable") for group in groups):
        return None, "differentiable=True: torch has no fused or foreach kernel for that"
    params = [p for group in groups for p in group["params"]]
    if not params:
        return None, "its parameter groups hold no parameters: nothing to switch"
    makers = [sparse[id(p)] for p in params if id(p) in sparse]
    if makers or any(p.grad is not None and p.grad.is_sparse for p in params):
        maker = f" from {makers[0]}" if makers else ""
        return None, (
            f"some of its parameters get sparse gradients{maker}, which torch's fused "
            f"kernels refuse: left as it is"
        )
    places = list(dict.fromkeys(pair for g in groups for pair in _devices_and_dtypes(g)))
    where = ", ".join(sorted({str(device.type) for device, _ in places}))
    if "fused" in optimizer.defaults:
        failures = [why for g in groups if (why := _probe(cls, g, "fused")) is not None]
        if not failures:
            return "fused", f"torch's fused {name} kernel on {where}"
        fused_no = f"torch's fused {name} {failures[0]}"
    else:
        fused_no = f"torch has no fused {name}"
    if "foreach" not in optimizer.defaults:
        return None, f"{fused_no}, nor a foreach one"
    foreach_devices = _compat.foreach_kernel_devices()
    if not all(device.type in foreach_devices for device, _ in places):
        return None, (
            f"{fused_no}, and its foreach kernels run on {', '.join(foreach_devices)} only "
            f"(parameters on {where})"
        )
    failures = [why for g in groups if (why := _probe(cls, g, "foreach")) is not None]
    if failures:
        return None, f"{fused_no}, and its foreach kernel {failures[0]}"
    return "foreach", f"{fused_no}; foreach (multi-tensor) kernels on {where}"


def _apply(
    optimizer: torch.optim.Optimizer, implementation: Implementation, groups: Sequence[int]
) -> None:
    """Set the flags on the groups at these indices, and step counts where they are read."""
    for index in groups:
        if index >= len(optimizer.param_groups):  # param_groups replaced by a shorter list
            continue
        group = optimizer.param_groups[index]
        if "fused" in optimizer.defaults:  # (a fused=False key would be saved in checkpoints)
            group["fused"] = implementation == "fused"
        if "foreach" in optimizer.defaults:
            group["foreach"] = implementation == "foreach"
        if implementation != "fused":
            continue
        for param in group["params"]:
            state: dict[str, Any] = optimizer.state.get(param) or {}
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device != param.device:
                # The fused kernel reads the step count on the parameter's device.
                state["step"] = step.to(device=param.device, dtype=torch.float32)


def _flags(group: Mapping[str, Any]) -> dict[str, Any]:
    return {key: group.get(key) for key in ("fused", "foreach") if key in group}


def _added_group_refusal(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], record: _Switch
) -> tuple[str, bool] | None:
    """Why a group added after the switch cannot take the switch's flag, and whether that
    deserves a warning (not where the group's own flags chose); None where it can."""
    flag = record.implementation
    name = type(optimizer).__name__
    if group.get(flag) is True:
        return f"`{flag}=True` already, as added", False
    for key in ("fused", "foreach"):
        if group.get(key) is False:
            return f"`{key}=False` was set explicitly: left as chosen", False
    if group.get("foreach") is True:
        return "`foreach=True` was set explicitly: left as chosen", False
    if not group["params"]:
        return "it holds no parameters", False
    if group.get("differentiable"):
        return "differentiable=True: torch has no fused or foreach kernel for that", True
    model = record.model() if record.model is not None else None
    sparse = _sparse_gradient_parameters(model)
    makers = [sparse[id(p)] for p in group["params"] if id(p) in sparse]
    if makers or any(p.grad is not None and p.grad.is_sparse for p in group["params"]):
        maker = f" from {makers[0]}" if makers else ""
        return f"its parameters get sparse gradients{maker}, which the kernel refuses", True
    places = _devices_and_dtypes(group)
    if flag == "foreach":
        foreach_devices = _compat.foreach_kernel_devices()
        if not all(device.type in foreach_devices for device, _ in places):
            return f"the foreach kernels run on {', '.join(foreach_devices)} only", True
    why = _probe(type(optimizer), group, flag)  # SYNC: once per added group, not per step
    return None if why is None else (f"torch's {flag} {name} {why}", True)


def _describe(index: int, group: dict[str, Any], record: _Switch) -> str:
    """``group 1 (4 parameters: backbone.0.weight, ...)``, naming them where the model is known."""
    params = group["params"]
    model = record.model() if record.model is not None else None
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    shown = [names[id(p)] for p in params[:3] if id(p) in names]
    listed = f": {', '.join(shown)}{', ...' if len(params) > len(shown) else ''}" if shown else ""
    return f"group {index} ({len(params)} parameter{'s' if len(params) != 1 else ''}{listed})"


def _adopt_added_groups(optimizer: torch.optim.Optimizer, record: _Switch) -> None:
    """Give the groups added since the switch (``add_param_group``) the switch's flag.

    Each is checked as the first switch checked its groups (the same probe, on its own
    devices and dtypes). One that cannot take it stays as it was added, with a warning
    that names it, unless its own flags chose so; either way it is seen once.
    """
    groups = optimizer.param_groups
    for index in range(len(record.original), len(groups)):
        group = groups[index]
        record.original.append(_flags(group))
        refusal = _added_group_refusal(optimizer, group, record)
        if refusal is None:
            _apply(optimizer, record.implementation, [index])
            log.debug("%s: added %s switched to %s", type(optimizer).__name__,
                      _describe(index, group, record), record.implementation)  # fmt: skip
            continue
        why, warn = refusal
        record.left[index] = why
        if warn:
            rank_zero_warn(
                f"FusedOptimizer: parameter {_describe(index, group, record)} of "
                f"{type(optimizer).__name__}, added after the switch to {record.implementation}, "
                f"runs as it was added, unswitched: {why}. Its updates are correct, only "
                f"not on the {record.implementation} kernel."
            )
        else:
            log.debug("%s: added %s left as it was: %s", type(optimizer).__name__,
                      _describe(index, group, record), why)  # fmt: skip


def _saved_as_unswitched(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Make a state_dict what the optimizer would save had it never been switched."""
    original = getattr(optimizer, _MARK).original
    groups = state_dict.get("param_groups", [])
    for saved, flags in zip(groups, original, strict=False):
        saved.update(flags)
    keep_on_device = any(flags.get("fused") or g.get("capturable")
                         for flags, g in zip(original, groups, strict=False))  # fmt: skip
    if keep_on_device:
        return
    for param_state in state_dict.get("state", {}).values():
        step = param_state.get("step") if isinstance(param_state, dict) else None
        if isinstance(step, torch.Tensor) and step.device.type != "cpu":
            param_state["step"] = step.cpu()  # a copy: the live state keeps its own


def _install_hooks(optimizer: torch.optim.Optimizer, record: _Switch) -> None:
    setattr(optimizer, _MARK, record)

    def on_save(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        _saved_as_unswitched(opt, state_dict)
        return state_dict

    def on_load(opt: torch.optim.Optimizer) -> None:
        # The loaded groups carry the original flags: switch the switched groups again,
        # and check any group added since.
        _apply(opt, record.implementation, record.switched())
        _adopt_added_groups(opt, record)

    def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if len(opt.param_groups) > len(record.original):  # add_param_group since: a len()
            _adopt_added_groups(opt, record)

    optimizer.register_state_dict_post_hook(on_save)
    optimizer.register_load_state_dict_post_hook(on_load)
    optimizer.register_step_pre_hook(before_step)


def _again(optimizer: torch.optim.Optimizer, record: _Switch) -> str:
    """The reason reported by a later call on an optimizer switched before."""
    reason = f"switched to {record.implementation} before"
    added = range(record.switched_at_start, len(record.original))
    switched = [i for i in added if i not in record.left]
    if switched:
        reason += f"; group(s) {', '.join(map(str, switched))} added since switched too"
    for index in added:
        if index in record.left and index < len(optimizer.param_groups):
            group = optimizer.param_groups[index]
            reason += f"; {_describe(index, group, record)}, added since, left as it was: " \
                      f"{record.left[index]}"  # fmt: skip
    return reason


def fuse_optimizers(
    optimizers: Iterable[Any], *, model: nn.Module | None = None
) -> list[OptimizerSwitch]:
    """Switch each optimizer to torch's fused kernels where torch has them, else foreach.

    The optimizers are changed in place (a flag per parameter group, read at the next
    ``step()``); their state is kept. ``state_dict()`` keeps saving what the
    unswitched optimizer would, and ``load_state_dict()`` switches again, so
    checkpoints are interchangeable with plain runs. Wrapped optimizers (Lightning's,
    DeepSpeed's ZeRO) are switched inside. Optimizers that are not torch's own, whose
    fused/foreach flag was set explicitly (``fused=False``, ``foreach=False`` or
    ``foreach=True``), whose kernel fails or disagrees with the plain step on a probe of
    their parameters' devices and dtypes, or that hold parameters getting sparse
    gradients, are left alone. A group added to a switched optimizer later
    (``add_param_group``, e.g. by ``BackboneFinetuning``) is given the same flag before
    the next ``step()``, after the same probe; one that fails it stays as it was added,
    with a warning that names it.

    Fused kernels compute the same update in another order: expect differences at
    the level of float rounding (about 1e-7 relative in float32), not more.

    Args:
        optimizers: a list (any iterable) of optimizers, e.g. ``trainer.optimizers``.
        model: the model the optimizers train. Where given, optimizers holding the
            weights of an ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True`` are
            left alone (the fused kernels refuse sparse gradients). Without it, only
            gradients already sparse at the call are seen.

    Returns:
        One :class:`OptimizerSwitch` per optimizer: what it runs now, or why nothing
        changed.

    Example::

        >>> import torch
        >>> model = torch.nn.Linear(4, 2)
        >>> adamw = torch.optim.AdamW(model.parameters())
        >>> lbfgs = torch.optim.LBFGS(model.parameters())
        >>> [s.implementation for s in fuse_optimizers([adamw, lbfgs])]
        ['fused', None]
        >>> adamw.param_groups[0]["fused"], adamw.state_dict()["param_groups"][0]["fused"]
        (True, None)
    """
    if (
        isinstance(optimizers, (str, bytes, Mapping))
        or _torch_optimizer(optimizers) is not None
        or not isinstance(optimizers, Iterable)
    ):
        _validation.fail("optimizers", optimizers, "must be a list of optimizers",
                         "pass a list, e.g. `fuse_optimizers([optimizer])` or "
                         "`fuse_optimizers(trainer.optimizers)`")  # fmt: skip
    _validation.optional(_validation.instance, "model", model, kinds=nn.Module,
                         what="a torch.nn.Module (or None)",
                         fix="pass the model the optimizers train, or leave it out")  # fmt: skip
    sparse = _sparse_gradient_parameters(model)
    results: list[OptimizerSwitch] = []
    for index, wrapped in enumerate(optimizers):
        optimizer = _torch_optimizer(wrapped)
        if optimizer is None:
            results.append(OptimizerSwitch(index, type(wrapped).__name__, None,
                                           "not a torch.optim.Optimizer"))  # fmt: skip
            continue
        implementation: Implementation | None
        record: _Switch | None = getattr(optimizer, _MARK, None)
        if record is not None:  # a later fit() handing back the same optimizer
            if model is not None:
                record.model = weakref.ref(model)
            _apply(optimizer, record.implementation, record.switched())
            _adopt_added_groups(optimizer, record)
            implementation, reason = record.implementation, _again(optimizer, record)
        else:
            implementation, reason = _choose(optimizer, sparse)
            if implementation is not None:
                groups = optimizer.param_groups
                owner = weakref.ref(model) if model is not None else None
                record = _Switch(
                    implementation, [_flags(g) for g in groups], len(groups), model=owner
                )
                _install_hooks(optimizer, record)
                _apply(optimizer, implementation, record.switched())
        log.debug("%s: %s (%s)", type(optimizer).__name__, implementation, reason)
        results.append(OptimizerSwitch(index, type(optimizer).__name__, implementation, reason))
    return results


class FusedOptimizer(L.Callback):
    """Runs :func:`fuse_optimizers` on the Trainer's optimizers when training starts.

    After the strategy has built them (``configure_optimizers``, DDP, the ZeRO-2
    presets, DeepSpeed's wrapper), and after a resumed run has loaded their state: not
    at fit start, where ``BackboneFinetuning`` puts back the parameter groups it saved in
    its own state, with the flags a switch wrote, which would read as chosen by hand.
    ``switched`` lists an :class:`OptimizerSwitch` per optimizer: which kernel it runs,
    or why it was left as it was. Per step, a step pre-hook only
    compares the number of parameter groups with the number switched, to switch a group
    added since (``BackboneFinetuning`` unfreezing the backbone) before its first step.

    Args:
        verbose: print what was switched (rank 0).

    Example::

        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[FusedOptimizer()], logger=False)
    """

    def __init__(self, *, verbose: bool = True) -> None:
        _validation.boolean("verbose", verbose)
        self.verbose = verbose
        self.switched: list[OptimizerSwitch] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.switched = fuse_optimizers(trainer.optimizers, model=pl_module)
        if self.verbose and self.switched:
            lines = [
                f"  {s.index}: {s.optimizer} -> {s.implementation or 'unchanged'} ({s.reason})"
                for s in self.switched
            ]
            rank_zero_info("FusedOptimizer:\n" + "\n".join(lines))
