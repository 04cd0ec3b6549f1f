"""A module's counters: the plain Python numbers and flags it keeps outside tensors.

``self.calls += 1``, ``self.seen += len(x)``, ``self.training``: state a forward or a
training step may change like a buffer's, which a checkpoint's recomputation and a
micro-batch trial must put back. Only plain ``int``, ``float`` and ``bool`` count (not
a subclass such as an enum or NumPy's scalars): their values are compared and restored
without touching a device.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["COUNTER_TYPES", "counters", "is_counter"]

COUNTER_TYPES: tuple[type, ...] = (int, float, bool)


def is_counter(value: Any) -> bool:
    """Whether ``value`` is a counter: a plain ``int``, ``float`` or ``bool``."""
    return type(value) in COUNTER_TYPES


def counters(module: nn.Module) -> dict[str, Any]:
    """The counters ``module`` holds as attributes, by name (``{"seen": 3, ...}``)."""
    return {k: v for k, v in vars(module).items() if type(v) in COUNTER_TYPES}
