"""RegionalCompile refuses a backend name torch does not know when it is built, not when
the fit starts (after the data and the model were set up)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_speedkit import RegionalCompile, SpeedkitConfigError
from lightning_speedkit.compute import compile_blocks

from .models import Net


def test_an_unknown_backend_name_is_refused_at_construction_as_compile_blocks_does() -> None:
    with pytest.raises(SpeedkitConfigError) as by_function:
        compile_blocks(Net(), backend="nope")
    with pytest.raises(SpeedkitConfigError) as by_callback:
        RegionalCompile(backend="nope")
    assert str(by_callback.value) == str(by_function.value)  # the same message, fix included
    assert "`backend` is not a torch.compile backend" in str(by_callback.value)
    assert "'nope'" in str(by_callback.value)


@pytest.mark.parametrize("backend", ["inductor", "eager", "aot_eager"])
def test_registered_backend_names_are_taken(backend: str) -> None:
    """``eager`` and ``aot_eager`` are registered but not listed by default: still taken."""
    assert RegionalCompile(backend=backend, verbose=False).backend == backend


def test_a_callable_backend_is_taken_without_looking_up_a_name() -> None:
    def backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return graph.forward

    assert RegionalCompile(backend=backend, verbose=False).backend is backend
