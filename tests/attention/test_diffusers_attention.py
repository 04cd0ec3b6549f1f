"""diffusers' ``Attention`` as the kit meets it: found, swapped or skipped, and quiet.

diffusers' attention module hands its work to a processor object: the default
``AttnProcessor2_0`` calls SDPA (fused already), the classic ``AttnProcessor`` writes the
attention out with ``torch.baddbmm`` (found by tracing, swapped). Its ``to_out`` is a
``ModuleList([Linear, Dropout])``. The modules here copy that layout in plain torch
(:mod:`tests.helpers.diffusers_like`).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_speedkit import swap_attention
from lightning_speedkit.attention._own_calls import calls_sdpa
from lightning_speedkit.attention._structural import structural_match
from tests.helpers.diffusers_like import (
    Attention,
    ClassicProcessor,
    SdpaProcessor,
    Transformer2D,
)

ATTENTIONS = [f"transformer_blocks.{i}.attn{j}" for i in range(2) for j in (1, 2)]


class ModuleSdpaProcessor(nn.Module):
    """A processor that is a module (diffusers' IP-Adapter processors are), SDPA in its
    ``forward`` under another name (as a module may import it)."""

    def forward(
        self, attn: Attention, hidden_states: Tensor, context: Tensor | None = None, *_: Any
    ) -> Tensor:
        sdpa = F.scaled_dot_product_attention
        context = hidden_states if context is None else context
        q, k, v = (attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context))
        q, k, v = (t.unflatten(-1, (attn.heads, -1)).transpose(1, 2) for t in (q, k, v))
        return attn.to_out[0](sdpa(q, k, v).transpose(1, 2).flatten(2))  # type: ignore[no-any-return]


PROCESSORS = {"object": SdpaProcessor, "module": ModuleSdpaProcessor}


def _inputs() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2, 16, 32, generator=generator), torch.randn(2, 5, 24, generator=generator)


@pytest.mark.parametrize("processor", sorted(PROCESSORS))
def test_attention_that_calls_sdpa_through_its_processor_is_fused_already(processor: str) -> None:
    """diffusers' default processor: reported as fused already, not "found no attention"."""
    torch.manual_seed(0)
    model = Transformer2D(processor=PROCESSORS[processor])
    plain = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = swap_attention(model, "sdpa", sample=_inputs())
    assert [str(w.message) for w in caught if "register_adapter" in str(w.message)] == []
    assert report.skipped == [(name, "Attention: calls SDPA itself: fused already")
                              for name in ATTENTIONS]  # fmt: skip
    assert report.modules == []
    torch.testing.assert_close(model(*_inputs()), plain(*_inputs()), rtol=0, atol=0)


def test_which_processors_call_sdpa() -> None:
    assert calls_sdpa(Attention(32, processor=SdpaProcessor()))
    assert calls_sdpa(Attention(32, processor=ModuleSdpaProcessor()))
    assert not calls_sdpa(Attention(32, processor=ClassicProcessor()))
    # The classic processor's attention is left to tracing, which swaps it (its to_out is
    # no linear the structural forward could call).
    assert structural_match(Attention(32, processor=ClassicProcessor())) is None


def test_a_processor_is_not_looked_for_where_the_forward_does_not_call_one() -> None:
    class Holder(nn.Module):  # a `processor` attribute the forward never reads
        def __init__(self) -> None:
            super().__init__()
            self.heads, self.processor = 4, SdpaProcessor()
            self.to_q, self.to_k, self.to_v = (nn.Linear(32, 32) for _ in range(3))
            self.to_out = nn.ModuleList([nn.Linear(32, 32), nn.Dropout(0.0)])

        def forward(self, x: Tensor) -> Tensor:
            return x

    assert not calls_sdpa(Holder())
    assert structural_match(Holder()) is None


def test_real_diffusers_default_processor_is_fused_already() -> None:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(32, 64), down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8, attention_head_dim=16,
    )  # fmt: skip
    sample = {"sample": torch.randn(2, 3, 8, 8), "timestep": torch.tensor([10, 500])}
    report = swap_attention(unet, "sdpa", sample=sample)
    assert [why for _, why in report.skipped] == ["Attention: calls SDPA itself: fused already"] * 4
    assert report.modules == []
