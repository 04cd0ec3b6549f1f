"""Small inputs for an attention module, where it runs.

The adapters' ``example_inputs`` build on these: a parity check when
:func:`~lightning_speedkit.swap_attention` is given no sample runs the module on one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

#: A call's ``(args, kwargs)``.
Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def device_of(module: nn.Module) -> torch.device | None:
    """The device of ``module``'s first parameter (``None`` if it has none)."""
    for tensor in module.parameters():
        return tensor.device
    return None


def tokens(module: nn.Module, width: int, length: int = 16) -> Tensor:
    """A fixed random ``(2, length, width)`` batch in ``module``'s dtype, on its device."""
    device = device_of(module)
    dtype = next((p.dtype for p in module.parameters()), torch.float32)
    generator = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn(2, length, width, generator=generator, dtype=dtype).to(device)
