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


def _masked_inputs(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """PixArt's call: hidden states, a caption, and which caption tokens are real."""
    generator = torch.Generator().manual_seed(seed)
    x, context = (
        torch.randn(2, 16, 32, generator=generator),
        torch.randn(2, 5, 24, generator=generator),
    )
    keep = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]).roll(seed, dims=1)
    return x, context, keep


def _grads(model: nn.Module, inputs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    out.square().mean().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return out.detach(), grads


def test_masked_cross_attention_runs_fused_with_the_plain_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """diffusers' classic processor adds its mask with ``baddbmm(mask, q, k^T, beta=1)``:
    the cross-attention was reverted ("no attention ran fused on these inputs")."""
    torch.manual_seed(0)
    model = Transformer2D(processor=ClassicProcessor).train()
    plain = copy.deepcopy(model)
    report = swap_attention(model, "sdpa", sample=_masked_inputs(0))
    assert report.swapped == ATTENTIONS
    assert {(m.status, m.checked) for m in report.modules} == {("active", "forward+backward")}
    masks: list[Tensor | None] = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args: Any, **kwargs: Any) -> Tensor:
        masks.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    for seed in range(1, 3):
        monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
        out, grads = _grads(model, _masked_inputs(seed))
        monkeypatch.undo()
        plain_out, plain_grads = _grads(plain, _masked_inputs(seed))
        torch.testing.assert_close(out, plain_out, rtol=1e-5, atol=1e-6)
        error = ((grads - plain_grads).abs().max() / plain_grads.abs().max()).item()
        assert error < 1e-5, f"largest relative gradient error {error:.2e}"
    assert [m is None for m in masks] == [True, False] * 4  # attn2 got the caption's mask
    assert all(m is not None and m.shape[-1] == 5 for m in masks[1::2])


class BaddbmmAttention(nn.Module):
    """Scores by ``torch.baddbmm(bias, q, k^T, beta=..., alpha=scale)`` with heads folded
    into the batch, the bias of any shape that broadcasts into the scores'."""

    def __init__(self, beta: float) -> None:
        super().__init__()
        self.heads, self.beta = 4, beta
        self.to_q, self.to_k, self.to_v, self.to_o = (nn.Linear(32, 32) for _ in range(4))

    def fold(self, t: Tensor) -> Tensor:
        b, n, _ = t.shape
        return t.unflatten(-1, (self.heads, -1)).transpose(1, 2).reshape(b * self.heads, n, -1)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        q, k, v = (self.fold(f(x)) for f in (self.to_q, self.to_k, self.to_v))
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), beta=self.beta, alpha=8**-0.5)
        out = torch.bmm(scores.softmax(dim=-1), v)
        return self.to_o(out.unflatten(0, (-1, self.heads)).transpose(1, 2).flatten(2))  # type: ignore[no-any-return]


@pytest.mark.parametrize("beta", [1.0, 0.5])
@pytest.mark.parametrize("shape", [(8, 1, 6), (8, 6, 6), (6,)], ids=["keys", "full", "row"])
def test_baddbmm_with_an_additive_bias_is_fused(beta: float, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    module = BaddbmmAttention(beta)
    plain = copy.deepcopy(module)
    bias = torch.randn(shape) - 10000.0 * (torch.rand(shape) < 0.3)  # a padding mask and a bias
    x = torch.randn(2, 6, 32)
    report = swap_attention(module, "sdpa", sample=(x, bias))
    assert [(m.status, m.checked) for m in report.modules] == [("active", "forward+backward")]
    y = torch.randn(2, 6, 32)
    out, grads = _grads(module, (y, bias))
    plain_out, plain_grads = _grads(plain, (y, bias))
    torch.testing.assert_close(out, plain_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads, plain_grads, rtol=1e-4, atol=1e-6)


def test_real_diffusers_pixart_masked_cross_attention_is_swapped() -> None:
    diffusers = pytest.importorskip("diffusers")
    from diffusers.models.attention_processor import AttnProcessor

    torch.manual_seed(0)
    pixart = diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
        num_layers=2, sample_size=8, patch_size=2, cross_attention_dim=32, caption_channels=24,
        norm_num_groups=8,
    ).train()  # fmt: skip
    pixart.set_attn_processor(AttnProcessor())
    plain = copy.deepcopy(pixart)
    call = {
        "hidden_states": torch.randn(2, 4, 8, 8), "timestep": torch.tensor([10, 500]),
        "encoder_hidden_states": torch.randn(2, 5, 24),
        "encoder_attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
    }  # fmt: skip
    report = swap_attention(pixart, "sdpa", sample=call)
    assert len(report.swapped) == 4
    assert {m.status for m in report.modules} == {"active"}

    def grads(model: nn.Module) -> tuple[Tensor, Tensor]:
        return _grads(_Sample(model, call), ())

    out, g = grads(pixart)
    plain_out, plain_g = grads(plain)
    torch.testing.assert_close(out, plain_out, rtol=1e-5, atol=1e-6)
    assert ((g - plain_g).abs().max() / plain_g.abs().max()).item() < 1e-5


class _Sample(nn.Module):
    """A diffusers model called with keyword arguments, its ``.sample`` out."""

    def __init__(self, model: nn.Module, call: dict[str, Any]) -> None:
        super().__init__()
        self.model, self.call = model, call

    def forward(self) -> Tensor:
        return self.model(**self.call).sample  # type: ignore[no-any-return]


@pytest.mark.parametrize("processor", ["sdpa", "classic"])
def test_swapping_reads_no_config_key_as_an_attribute(processor: str) -> None:
    """diffusers' ``ModelMixin.__getattr__`` serves config keys with a deprecation warning:
    the structural adapter asked every module for ``num_attention_heads``, and the
    top-level model warned on every swap."""
    torch.manual_seed(0)
    model = Transformer2D(processor={"sdpa": SdpaProcessor, "classic": ClassicProcessor}[processor])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = swap_attention(model, "sdpa", sample=_inputs())
    assert [str(w.message) for w in caught if "config attribute" in str(w.message)] == []
    assert len(report.swapped if processor == "classic" else report.skipped) == 4


class _HeadsOnTheClass(nn.Module):
    """A head count on the class, not the instance."""

    n_head = 4

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x: Tensor) -> Tensor:
        return x


class _HeadsAsAProperty(_HeadsOnTheClass):
    """A head count that is a property (read before ``n_head``: its name comes first)."""

    @property
    def num_heads(self) -> int:
        return 2


def test_head_counts_are_still_read_from_classes_and_properties() -> None:
    on_class, as_property = (
        structural_match(_HeadsOnTheClass()),
        structural_match(_HeadsAsAProperty()),
    )
    assert (on_class.heads, on_class.head_dim) == (4, 8)
    assert (as_property.heads, as_property.head_dim) == (2, 16)
