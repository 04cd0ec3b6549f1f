"""_surgery: a model whose forwards the kit replaced pickles and loads, and keeps them."""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_speedkit import _surgery, swap_attention
from lightning_speedkit.attention._discovery import probed
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
        assert _surgery.wrapper(block).args[0] is block
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


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=32, n_layer=2,
                                     n_head=4, attn_implementation="eager")  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _traced_model(block: str) -> nn.Module:
    from tests.attention.test_swap_and_checkpoint import HoldingBlock, InlineBlock

    return nn.Sequential(
        *(InlineBlock() if block == "inline" else HoldingBlock() for _ in range(2))
    )


#: family -> (model, sample, the swapped modules, the blocks to checkpoint)
FAMILIES: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any], list[str], str]] = {
    "traced_inline": (
        lambda: _traced_model("inline"),
        lambda: torch.randn(2, 8, 32),
        ["0", "1"],
        "InlineBlock",
    ),
    "traced_submodule": (
        lambda: _traced_model("submodule"),
        lambda: torch.randn(2, 8, 32),
        ["0.attention", "1.attention"],
        "HoldingBlock",
    ),
    "multihead_attention": (
        lambda: nn.Sequential(
            *(
                nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
                for _ in range(2)
            )
        ),
        lambda: torch.randn(2, 8, 32),
        ["0.self_attn", "1.self_attn"],
        "TransformerEncoderLayer",
    ),
    "huggingface": (_gpt2, lambda: torch.randint(0, 40, (2, 12)), [""], "GPT2Block"),
}


def _output(model: nn.Module, sample: Tensor) -> Tensor:
    out = model(sample)
    return out if isinstance(out, Tensor) else out.logits  # type: ignore[no-any-return]


@ROUND_TRIPS
@pytest.mark.parametrize("checkpointed", [False, True], ids=["swapped", "swapped_checkpointed"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_swapped_loads_still_swapped(
    family: str, checkpointed: bool, round_trip: Callable[[nn.Module], nn.Module]
) -> None:
    """The traced family's adapter held a lambda: ``torch.save(model)`` raised ``Can't
    pickle <lambda>`` once a trace had swapped something."""
    make, sample, names, block = FAMILIES[family]
    torch.manual_seed(0)
    model = make()
    x = sample()
    report = swap_attention(model, "sdpa")
    if checkpointed:
        assert checkpoint_blocks(model, blocks=[block])
    _output(model, x)  # the first call: traced families are found and swapped here
    assert report.swapped == names
    model.eval()
    loaded = round_trip(model)
    swaps = swapped_modules(loaded)
    assert sorted(swaps) == names
    for name, swap in swaps.items():
        module = loaded.get_submodule(name)
        assert swap.module is module  # the loaded module's swap runs the loaded module
        assert swap.original.__func__ is type(module).forward  # its own forward, not the kit's
    assert checkpointed_blocks(loaded) == checkpointed_blocks(model)
    assert torch.equal(_output(loaded, x), _output(model, x))


@ROUND_TRIPS
def test_a_model_saved_before_its_first_call_finds_its_attention_when_loaded(
    round_trip: Callable[[nn.Module], nn.Module],
) -> None:
    torch.manual_seed(0)
    model = _traced_model("submodule")
    report = swap_attention(model, "sdpa")
    loaded = round_trip(model)
    assert probed(loaded[0].attention)  # a second swap_attention leaves it to this discovery
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-6)
    assert (
        sorted(swapped_modules(loaded)) == sorted(report.swapped) == ["0.attention", "1.attention"]
    )


def test_a_call_setting_is_replayed_outermost_first_and_forgotten_after_its_call() -> None:
    events: list[str] = []

    def setting(name: str) -> Any:
        @contextlib.contextmanager
        def entered() -> Iterator[None]:
            events.append(f"enter {name}")
            yield
            events.append(f"exit {name}")

        return entered

    outer, inner = setting("outer"), setting("inner")
    seen: list[tuple[Any, ...]] = []

    def failing_call() -> None:
        with _surgery.call_setting(inner):
            seen.append(_surgery.call_settings())
            raise RuntimeError("the call failed")

    with _surgery.call_setting(outer):
        with pytest.raises(RuntimeError, match="the call failed"):
            failing_call()
        seen.append(_surgery.call_settings())
    assert seen == [(outer, inner), (outer,)]
    assert _surgery.call_settings() == ()
    events.clear()
    with _surgery.replayed((outer, inner)):
        events.append("recomputed")
    assert events == ["enter outer", "enter inner", "recomputed", "exit inner", "exit outer"]
