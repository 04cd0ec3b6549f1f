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

import logging
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_speedkit import _validation
from lightning_speedkit._optimizers import torch_optimizer
from lightning_speedkit.compute._fused_choice import choose, sparse_gradient_parameters
from lightning_speedkit.compute._fused_probe import Implementation
from lightning_speedkit.compute._fused_switch import (
    MARK,
    Switch,
    adopt_added_groups,
    apply_flags,
    describe,
    group_flags,
    install_hooks,
)

__all__ = ["FusedOptimizer", "OptimizerSwitch", "fuse_optimizers"]

log = logging.getLogger(__name__)


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


def _again(optimizer: torch.optim.Optimizer, record: Switch) -> str:
    """The reason reported by a later call on an optimizer switched before."""
    reason = f"switched to {record.implementation} before"
    added = range(record.switched_at_start, len(record.original))
    switched = [i for i in added if i not in record.left]
    if switched:
        reason += f"; group(s) {', '.join(map(str, switched))} added since switched too"
    for index in added:
        if index in record.left and index < len(optimizer.param_groups):
            group = optimizer.param_groups[index]
            reason += f"; {describe(index, group, record)}, added since, left as it was: " \
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
        or torch_optimizer(optimizers) is not None
        or not isinstance(optimizers, Iterable)
    ):
        _validation.fail("optimizers", optimizers, "must be a list of optimizers",
                         "pass a list, e.g. `fuse_optimizers([optimizer])` or "
                         "`fuse_optimizers(trainer.optimizers)`")  # fmt: skip
    _validation.optional(_validation.instance, "model", model, kinds=nn.Module,
                         what="a torch.nn.Module (or None)",
                         fix="pass the model the optimizers train, or leave it out")  # fmt: skip
    sparse = sparse_gradient_parameters(model)
    results: list[OptimizerSwitch] = []
    for index, wrapped in enumerate(optimizers):
        optimizer = torch_optimizer(wrapped)
        if optimizer is None:
            results.append(OptimizerSwitch(index, type(wrapped).__name__, None,
                                           "not a torch.optim.Optimizer"))  # fmt: skip
            continue
        implementation: Implementation | None
        record: Switch | None = getattr(optimizer, MARK, None)
        if record is not None:  # a later fit() handing back the same optimizer
            if model is not None:
                record.model = weakref.ref(model)
            apply_flags(optimizer, record.implementation, record.switched())
            adopt_added_groups(optimizer, record)
            implementation, reason = record.implementation, _again(optimizer, record)
        else:
            implementation, reason = choose(optimizer, sparse)
            if implementation is not None:
                groups = optimizer.param_groups
                owner = weakref.ref(model) if model is not None else None
                record = Switch(
                    implementation, [group_flags(g) for g in groups], len(groups), model=owner
                )
                install_hooks(optimizer, record)
                apply_flags(optimizer, implementation, record.switched())
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
