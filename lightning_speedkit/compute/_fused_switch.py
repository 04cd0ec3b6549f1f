"""A switch kept on the optimizer: its flags set, checkpoints saved as if unswitched.

The record of what was switched lives on the optimizer itself; its ``state_dict`` hook
writes the groups' original flags (and CPU step counts) into what is saved, its
``load_state_dict`` hook switches again after a resume, and a step pre-hook gives
groups added since (``add_param_group``) the same flag, after the same probe.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_speedkit.compute._fused_choice import added_group_refusal
from lightning_speedkit.compute._fused_probe import Implementation

__all__ = ["MARK", "Switch", "adopt_added_groups", "apply_flags", "describe", "group_flags",
           "install_hooks"]  # fmt: skip

log = logging.getLogger(__name__)

MARK = "_speedkit_fused"  # attribute on a switched optimizer: its Switch record


@dataclass
class Switch:
    """What the switch did to one optimizer, kept on it (as ``MARK``) for its hooks."""

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


def apply_flags(
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


def group_flags(group: Mapping[str, Any]) -> dict[str, Any]:
    return {key: group.get(key) for key in ("fused", "foreach") if key in group}


def describe(index: int, group: dict[str, Any], record: Switch) -> str:
    """``group 1 (4 parameters: backbone.0.weight, ...)``, naming them where the model is known."""
    params = group["params"]
    model = record.model() if record.model is not None else None
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    shown = [names[id(p)] for p in params[:3] if id(p) in names]
    listed = f": {', '.join(shown)}{', ...' if len(params) > len(shown) else ''}" if shown else ""
    return f"group {index} ({len(params)} parameter{'s' if len(params) != 1 else ''}{listed})"


def adopt_added_groups(optimizer: torch.optim.Optimizer, record: Switch) -> None:
    """Give the groups added since the switch (``add_param_group``) the switch's flag.

    Each is checked as the first switch checked its groups (the same probe, on its own
    devices and dtypes). One that cannot take it stays as it was added, with a warning
    that names it, unless its own flags chose so; either way it is seen once.
    """
    groups = optimizer.param_groups
    for index in range(len(record.original), len(groups)):
        group = groups[index]
        record.original.append(group_flags(group))
        model = record.model() if record.model is not None else None
        refusal = added_group_refusal(optimizer, group, record.implementation, model)
        if refusal is None:
            apply_flags(optimizer, record.implementation, [index])
            log.debug("%s: added %s switched to %s", type(optimizer).__name__,
                      describe(index, group, record), record.implementation)  # fmt: skip
            continue
        why, warn = refusal
        record.left[index] = why
        if warn:
            rank_zero_warn(
                f"FusedOptimizer: parameter {describe(index, group, record)} of "
                f"{type(optimizer).__name__}, added after the switch to {record.implementation}, "
                f"runs as it was added, unswitched: {why}. Its updates are correct, only "
                f"not on the {record.implementation} kernel."
            )
        else:
            log.debug("%s: added %s left as it was: %s", type(optimizer).__name__,
                      describe(index, group, record), why)  # fmt: skip


def _saved_as_unswitched(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Make a state_dict what the optimizer would save had it never been switched."""
    original = getattr(optimizer, MARK).original
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


def install_hooks(optimizer: torch.optim.Optimizer, record: Switch) -> None:
    setattr(optimizer, MARK, record)

    def on_save(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        _saved_as_unswitched(opt, state_dict)
        return state_dict

    def on_load(opt: torch.optim.Optimizer) -> None:
        # The loaded groups carry the original flags: switch the switched groups again,
        # and check any group added since.
        apply_flags(opt, record.implementation, record.switched())
        adopt_added_groups(opt, record)

    def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if len(opt.param_groups) > len(record.original):  # add_param_group since: a len()
            adopt_added_groups(opt, record)

    optimizer.register_state_dict_post_hook(on_save)
    optimizer.register_load_state_dict_post_hook(on_load)
    optimizer.register_step_pre_hook(before_step)
