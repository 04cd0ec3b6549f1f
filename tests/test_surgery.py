"""_surgery: a model whose forwards the kit replaced pickles and loads, and keeps them."""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from lightning_speedkit import _surgery, swap_attention
from lightning_speedkit.attention.swap import swapped_modules
from lightning_speedkit.distributed import checkpoint_blocks, checkpointed_blocks


def _pickled(model: nn.Module) -> nn.Module:
    loaded: nn.Module = pickle.loads(pickle.dumps(model))
    return loaded


def _torch_saved(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded: nn.Module = torch.load(buffer, weights_only=False)
    return loaded


ROUND_TRIPS = pytest.mark.parametrize("round_trip", [_pickled, _torch_saved],
                                      ids=["pickle", "torch.save"])  # fmt: skip


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 8))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.ff(x)


def _loss_and_grads(model: nn.Module, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    torch.manual_seed(1)  # the same dropout masks
    model.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@ROUND_TRIPS
def test_a_checkpointed_model_loads_still_checkpointed(
    round_trip: Callable[[nn.Module], nn.Module],
) -> None:
    """Pickle stored the kit's bound method as ``getattr(block, "_call_replaced")``, which
    no block has: the model saved, but did not load."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(3)])
    names = checkpoint_blocks(model)
    loaded = round_trip(model)
    assert checkpointed_blocks(loaded) == names
    x = torch.randn(4, 8)
    loss, grads = _loss_and_grads(model, x)
    loaded_loss, loaded_grads = _loss_and_grads(loaded, x)
    assert torch.equal(loss, loaded_loss)
    assert all(torch.equal(g, h) for g, h in zip(grads, loaded_grads, strict=True))
    for block in loaded:  # each loaded block's forward runs the loaded block, not the saved one
        assert block.forward.__self__ is block
        assert _surgery.replaced_forward(block).args[0] is block
    loaded.eval()
    model.eval()
    assert torch.equal(model(x), loaded(x))


def test_other_bound_methods_pickle_as_before() -> None:
    linear = nn.Linear(2, 2)
    method = pickle.loads(pickle.dumps(linear.extra_repr))
    assert method() == linear.extra_repr()


@ROUND_TRIPS
def test_an_attention_swapped_model_loads_still_swapped(
    round_trip: Callable[[nn.Module], nn.Module],
) -> None:
    from speedkit_examples.vlm import VLM, VLMConfig

    torch.manual_seed(0)
    model = VLM(VLMConfig.preset("tiny", vocab_size=35))  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(1)
    inputs = (torch.randn(2, 3, 32, 32, generator=generator),
              torch.randint(0, 35, (2, 12), generator=generator))  # fmt: skip
    report = swap_attention(model, "sdpa", sample=inputs)
    assert report.swapped
    model.eval()
    loaded = round_trip(model)
    swaps = swapped_modules(loaded)
    assert sorted(swaps) == sorted(swapped_modules(model))
    assert all(swap.module is loaded.get_submodule(name) for name, swap in swaps.items())
    assert torch.equal(model(*inputs), loaded(*inputs))
