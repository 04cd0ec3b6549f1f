"""Learning rate scaled with the global batch, around each optimizer step only.

``(global batch / base global batch) ** p``, with p = 1 (``"linear"``, Goyal et al.
2017; SGD) or 1/2 (``"sqrt"``, often better for Adam). The scale is applied by a
step pre-hook and the exact values put back by a post-hook, so LR schedulers and
checkpoints keep their own values.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch

from lightning_speedkit._optimizers import torch_optimizer
from lightning_speedkit.errors import SpeedkitConfigError

LrScaling = Literal["linear", "sqrt"]
LR_POWER: dict[str, float] = {"linear": 1.0, "sqrt": 0.5}


def lr_factor(global_batch: int, base_global_batch: int, scaling: LrScaling) -> float:
    """The learning-rate factor at ``global_batch`` for a rate tuned at ``base_global_batch``.

    Example::

        >>> lr_factor(512, 128, "linear"), lr_factor(512, 128, "sqrt")
        (4.0, 2.0)
    """
    return (global_batch / base_global_batch) ** LR_POWER[scaling]


class LrScaler:
    """Multiplies every learning rate by :attr:`factor` during each optimizer step.

    Example::

        >>> import torch
        >>> param = torch.nn.Parameter(torch.ones(1))
        >>> sgd = torch.optim.SGD([param], lr=0.1)
        >>> scaler = LrScaler()
        >>> scaler.hook([sgd], "linear")
        >>> scaler.factor = 4.0
        >>> param.grad = torch.ones(1)
        >>> sgd.step()
        >>> round(param.item(), 6), sgd.param_groups[0]["lr"]  # a step of 0.4; lr kept
        (0.6, 0.1)
        >>> scaler.remove()
    """

    def __init__(self) -> None:
        self.factor = 1.0
        self._hooks: list[Any] = []
        self._saved_lrs: dict[int, list[float]] = {}

    def hook(self, optimizers: Iterable[Any], scaling: LrScaling | None) -> None:
        """Hook each optimizer (wrappers looked through); ``scaling`` names the setting
        in the error for an optimizer that is not a torch one. None: no scaling, no hooks."""
        if scaling is None:
            return
        for optimizer in optimizers:
            inner = torch_optimizer(optimizer)
            if inner is None:
                raise SpeedkitConfigError(
                    f"`lr_scaling={scaling!r}` needs a torch.optim.Optimizer, got "
                    f"{type(optimizer).__name__}. Scale the learning rate yourself, or use a "
                    f"torch optimizer."
                )
            self._hooks.append(inner.register_step_pre_hook(self._scale))
            self._hooks.append(inner.register_step_post_hook(self._unscale))

    def remove(self) -> None:
        """Take the hooks off."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _scale(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.factor == 1.0:
            return
        self._saved_lrs[id(optimizer)] = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * self.factor

    def _unscale(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        saved = self._saved_lrs.pop(id(optimizer), None)
        if saved is not None:  # the exact values back, not lr * f / f
            for group, lr in zip(optimizer.param_groups, saved, strict=True):
                group["lr"] = lr
