"""The torch optimizer inside the wrappers Lightning and DeepSpeed put around it."""

from __future__ import annotations

from typing import Any

import torch


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside wrappers (Lightning's ``LightningOptimizer``, DeepSpeed's
    ZeRO optimizers, each holding the next as ``.optimizer``), or None when there is none
    within four levels.

    Example::

        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> class Wrapper:
        ...     def __init__(self, optimizer):
        ...         self.optimizer = optimizer
        >>> torch_optimizer(Wrapper(Wrapper(sgd))) is sgd, torch_optimizer(object())
        (True, None)
    """
    for _ in range(4):
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None
