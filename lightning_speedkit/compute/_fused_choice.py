"""Which kernel an optimizer (or a group added to it later) can switch to, and why not.

The checks that leave an optimizer as it is (not torch's own, flags chosen by hand,
differentiable, sparse gradients, kernels on other devices) come first; the probe of
:mod:`~lightning_speedkit.compute._fused_probe` decides the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_speedkit import _compat
from lightning_speedkit.compute._fused_probe import Implementation, devices_and_dtypes, probe

__all__ = ["added_group_refusal", "choose", "sparse_gradient_parameters"]


def sparse_gradient_parameters(model: nn.Module | None) -> dict[int, str]:
    """id of each parameter of ``model`` getting sparse gradients -> the module that makes them."""
    found: dict[int, str] = {}
    for name, module in model.named_modules() if model is not None else ():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse is True:
            found[id(module.weight)] = f"`{name or type(module).__name__}` " \
                                       f"({type(module).__name__} with sparse=True)"  # fmt: skip
    return found


def choose(
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
    places = list(dict.fromkeys(pair for g in groups for pair in devices_and_dtypes(g)))
    where = ", ".join(sorted({str(device.type) for device, _ in places}))
    if "fused" in optimizer.defaults:
        failures = [why for g in groups if (why := probe(cls, g, "fused")) is not None]
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
    failures = [why for g in groups if (why := probe(cls, g, "foreach")) is not None]
    if failures:
        return None, f"{fused_no}, and its foreach kernel {failures[0]}"
    return "foreach", f"{fused_no}; foreach (multi-tensor) kernels on {where}"


def added_group_refusal(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    flag: Implementation,
    model: nn.Module | None,
) -> tuple[str, bool] | None:
    """Why a group added after the switch to ``flag`` cannot take that flag, and whether that
    deserves a warning (not where the group's own flags chose); None where it can. ``model``
    (the one the optimizer trains, where known) finds parameters with sparse gradients."""
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
    sparse = sparse_gradient_parameters(model)
    makers = [sparse[id(p)] for p in group["params"] if id(p) in sparse]
    if makers or any(p.grad is not None and p.grad.is_sparse for p in group["params"]):
        maker = f" from {makers[0]}" if makers else ""
        return f"its parameters get sparse gradients{maker}, which the kernel refuses", True
    places = devices_and_dtypes(group)
    if flag == "foreach":
        foreach_devices = _compat.foreach_kernel_devices()
        if not all(device.type in foreach_devices for device, _ in places):
            return f"the foreach kernels run on {', '.join(foreach_devices)} only", True
    why = probe(type(optimizer), group, flag)  # SYNC: once per added group, not per step
    return None if why is None else (f"torch's {flag} {name} {why}", True)
