"""A swapped model pickled before the swap's modules were split still loads.

Such a pickle names its classes where they lived then (``swap._SwappedForward``,
``swap.SwapReport``, ``_discovery._ById``, ...); those names still resolve.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator

import torch

from lightning_speedkit import swap_attention
from lightning_speedkit.attention._swap_report import ModuleSwap, SwapReport
from lightning_speedkit.attention._swapped_forward import _SwappedForward
from lightning_speedkit.attention._trace_record import _ById
from lightning_speedkit.attention.swap import swapped_modules
from speedkit_examples.vlm import VLM, VLMConfig

#: Each moved class and the module a pickle written before names it in.
BEFORE = {
    _SwappedForward: "lightning_speedkit.attention.swap",
    ModuleSwap: "lightning_speedkit.attention.swap",
    SwapReport: "lightning_speedkit.attention.swap",
    _ById: "lightning_speedkit.attention._discovery",
}


@contextlib.contextmanager
def _named_as_before() -> Iterator[None]:
    """Pickles written in here name each moved class where it lived before."""
    now = {cls: cls.__module__ for cls in BEFORE}
    for cls, module in BEFORE.items():
        cls.__module__ = module
    try:
        yield
    finally:
        for cls, module in now.items():
            cls.__module__ = module


def test_a_swapped_model_pickled_before_the_split_loads_and_computes_the_same() -> None:
    torch.manual_seed(0)
    model = VLM(VLMConfig.preset("tiny", vocab_size=35))  # type: ignore[arg-type]
    swap_attention(model, "sdpa")  # structural swaps, and probes on the rest
    with _named_as_before():
        data = pickle.dumps(model)
    for moved in (b"attention._swapped_forward", b"attention._swap_report", b"_trace_record"):
        assert moved not in data  # the pickle names the modules as before
    loaded = pickle.loads(data)
    assert swapped_modules(loaded).keys() == swapped_modules(model).keys()
    assert all(type(swap) is _SwappedForward for swap in swapped_modules(loaded).values())
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(2, 3, 32, 32, generator=generator)
    tokens = torch.randint(0, 35, (2, 12), generator=generator)
    model.eval()
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(images, tokens), model(images, tokens))
