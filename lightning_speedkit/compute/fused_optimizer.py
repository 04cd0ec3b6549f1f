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

Each switch is tried first on a throwaway parameter of the same device and dtype
(construct the optimizer with the flag, take one step), so a combination torch
does not support is reported, not discovered at the first real step.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_speedkit import _compat, _validation

__all__ = ["FusedOptimizer", "OptimizerSwitch", "fuse_optimizers"]

log = logging.getLogger(__name__)

Implementation = Literal["fused", "foreach"]
_MARK = "_speedkit_fused"  # attribute on a switched optimizer: its groups' original flags


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


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside wrappers (Lightning's, DeepSpeed's ZeRO), or None."""
    for _ in range(4):
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def _devices_and_dtypes(group: dict[str, Any]) -> list[tuple[torch.device, torch.dtype]]:
    return list(dict.fromkeys((p.device, p.dtype) for p in group["params"]))


def _probe(
    cls: type[torch.optim.Optimizer],
    group: dict[str, Any],
    flag: Implementation,
    device: torch.device,
    dtype: torch.dtype,
) -> str | None:
    """Construct ``cls`` with ``flag=True`` on a throwaway parameter and step it; None if fine."""
    accepted = inspect.signature(cls.__init__).parameters
    options = {k: v for k, v in group.items() if k in accepted and k not in ("params", "foreach",
                                                                            "fused")}  # fmt: skip
    options[flag] = True
    try:
        probe = torch.zeros(2, device=device, dtype=dtype, requires_grad=True)
        optimizer = cls([probe], **options)
        probe.grad = torch.zeros_like(probe)
        optimizer.step()
    except Exception as exc:  # torch refuses unsupported combinations with several error types
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _choose(optimizer: torch.optim.Optimizer) -> tuple[Implementation | None, str]:
    cls = type(optimizer)
    name = cls.__name__
    if not cls.__module__.startswith("torch.optim"):
        return None, (
            f"{name} is not one of torch's optimizers (a subclass or another library's); its "
            f"step may not read the fused/foreach flags"
        )
    groups = optimizer.param_groups
    if hasattr(optimizer, _MARK):  # a later fit() handing back the same optimizer
        before: Implementation = "fused" if groups[0].get("fused") else "foreach"
        return before, f"switched to {before} before"
    if all(group.get("fused") for group in groups):
        return None, "already fused (as constructed)"
    for flag in ("fused", "foreach"):
        if any(group.get(flag) is False for group in groups):
            return None, f"`{flag}=False` was set explicitly: left as chosen"
    if any(group.get("differentiable") for group in groups):
        return None, "differentiable=True: torch has no fused or foreach kernel for that"
    places = list(dict.fromkeys(pair for g in groups for pair in _devices_and_dtypes(g)))
    where = ", ".join(sorted({str(device.type) for device, _ in places}))
    if "fused" in optimizer.defaults:
        failures = [
            why for g in groups for device, dtype in _devices_and_dtypes(g)
            if (why := _probe(cls, g, "fused", device, dtype)) is not None
        ]  # fmt: skip
        if not failures:
            return "fused", f"torch's fused {name} kernel on {where}"
        fused_no = f"torch's fused {name} refused these parameters ({failures[0]})"
    else:
        fused_no = f"torch has no fused {name}"
    if all(group.get("foreach") for group in groups):
        return None, f"already foreach; {fused_no}"
    if "foreach" not in optimizer.defaults:
        return None, f"{fused_no}, nor a foreach one"
    foreach_devices = _compat.foreach_kernel_devices()
    if not all(device.type in foreach_devices for device, _ in places):
        return None, (
            f"{fused_no}, and its foreach kernels run on {', '.join(foreach_devices)} only "
            f"(parameters on {where})"
        )
    failures = [
        why for g in groups for device, dtype in _devices_and_dtypes(g)
        if (why := _probe(cls, g, "foreach", device, dtype)) is not None
    ]  # fmt: skip
    if failures:
        return None, f"{fused_no}, and its foreach kernel refused these parameters ({failures[0]})"
    return "foreach", f"{fused_no}; foreach (multi-tensor) kernels on {where}"


def _apply(optimizer: torch.optim.Optimizer, implementation: Implementation) -> None:
    """Set the flags on every group; step counts where the fused kernel reads them."""
    for group in optimizer.param_groups:
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


def _saved_as_unswitched(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Make a state_dict what the optimizer would save had it never been switched."""
    original: list[dict[str, Any]] = getattr(optimizer, _MARK)
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


def _install_hooks(optimizer: torch.optim.Optimizer, implementation: Implementation) -> None:
    setattr(optimizer, _MARK, [{key: group.get(key) for key in ("fused", "foreach") if key in group}
                               for group in optimizer.param_groups])  # fmt: skip

    def on_save(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        _saved_as_unswitched(opt, state_dict)
        return state_dict

    def on_load(opt: torch.optim.Optimizer) -> None:
        _apply(opt, implementation)  # the loaded groups carry the original flags

    optimizer.register_state_dict_post_hook(on_save)
    optimizer.register_load_state_dict_post_hook(on_load)


def fuse_optimizers(optimizers: Iterable[Any]) -> list[OptimizerSwitch]:
    """Switch each optimizer to torch's fused kernels where torch has them, else foreach.

    The optimizers are changed in place (a flag per parameter group, read at the next
    ``step()``); their state is kept. ``state_dict()`` keeps saving what the
    unswitched optimizer would, and ``load_state_dict()`` switches again, so
    checkpoints are interchangeable with plain runs. Wrapped optimizers (Lightning's,
    DeepSpeed's ZeRO) are switched inside. Optimizers that are not torch's own, or
    whose fused/foreach flag was set to False explicitly, are left alone.

    Fused kernels compute the same update in another order: expect differences at
    the level of float rounding (about 1e-7 relative in float32), not more.

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
    results: list[OptimizerSwitch] = []
    for index, wrapped in enumerate(optimizers):
        optimizer = _torch_optimizer(wrapped)
        if optimizer is None:
            results.append(OptimizerSwitch(index, type(wrapped).__name__, None,
                                           "not a torch.optim.Optimizer"))  # fmt: skip
            continue
        implementation, reason = _choose(optimizer)
        if implementation is not None:
            if not hasattr(optimizer, _MARK):
                _install_hooks(optimizer, implementation)
            _apply(optimizer, implementation)
        log.debug("%s: %s (%s)", type(optimizer).__name__, implementation, reason)
        results.append(OptimizerSwitch(index, type(optimizer).__name__, implementation, reason))
    return results


class FusedOptimizer(L.Callback):
    """Runs :func:`fuse_optimizers` on the Trainer's optimizers when fit starts.

    After the strategy has built them (``configure_optimizers``, DDP, the ZeRO-2
    presets, DeepSpeed's wrapper) and before a resumed run loads their state, which
    keeps the switch. ``switched`` lists an :class:`OptimizerSwitch` per optimizer:
    which kernel it runs, or why it was left as it was. Nothing is done per step.

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

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.switched = fuse_optimizers(trainer.optimizers)
        if self.verbose and self.switched:
            lines = [
                f"  {s.index}: {s.optimizer} -> {s.implementation or 'unchanged'} ({s.reason})"
                for s in self.switched
            ]
            rank_zero_info("FusedOptimizer:\n" + "\n".join(lines))
