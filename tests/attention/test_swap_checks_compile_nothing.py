"""The swap's checks run compiled blocks eagerly: RegionalCompile compiles each block once.

Run through ``compile_blocks``' blocks, the checks' batch-of-2 synthetic input, their eval
mode and their grad mode each compiled every block class anew (a tiny Qwen2: 1 graph
alone, 4 with the swap; T5, with four block variants, ran past dynamo's recompile limit).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from torch import nn

from lightning_speedkit import compile_blocks, swap_attention


def _qwen2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    return transformers.Qwen2ForCausalLM(config)


def _graphs_compiled(swap: str | None, sample: bool) -> tuple[int, list[float]]:
    """Graphs dynamo compiled over three training steps (and a call without gradients) of
    a Qwen2 whose blocks are compiled in place, swapped after that or not; the losses."""
    graphs: list[Any] = []

    def counting(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = _qwen2()
    compile_blocks(model, backend=counting)
    ids = torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    if swap is not None:
        report = swap_attention(model, swap, sample={"input_ids": ids} if sample else None)
        assert report.swapped == [""]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    if swap is not None:
        assert report.modules[0].checked == "forward+backward"
    return len(graphs), losses


@pytest.mark.parametrize(("swap", "sample"), [("sdpa", False), ("sdpa", True), ("auto", False)])
def test_the_swaps_checks_compile_no_graph_of_their_own(swap: str, sample: bool) -> None:
    alone, plain_losses = _graphs_compiled(None, sample=False)
    assert alone >= 1  # the blocks did compile
    swapped, losses = _graphs_compiled(swap, sample)
    assert swapped == alone
    torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-5)
