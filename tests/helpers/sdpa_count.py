"""What checkpointing tests of the attention swap share: an SDPA call counter and a gradient
comparison."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor


class CountSdpa:
    """Counts ``F.scaled_dot_product_attention`` calls: in the forward, and in backward
    (a checkpoint's recomputation)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.forward = self.recomputed = 0
        self._fused = F.scaled_dot_product_attention
        monkeypatch.setattr(F, "scaled_dot_product_attention", self)

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        if torch._C._current_graph_task_id() == -1:
            self.forward += 1
        else:
            self.recomputed += 1
        return self._fused(*args, **kwargs)  # type: ignore[no-any-return]


def assert_equal_grads(grads: Tensor, reference: Tensor, what: str) -> None:
    """Within fp32 noise of the reference: the largest error under 1e-5 of its largest entry."""
    assert grads.shape == reference.shape
    error = ((grads - reference).abs().max() / reference.abs().max()).item()
    assert error < 1e-5, f"{what}: largest relative gradient error {error:.2e}"
