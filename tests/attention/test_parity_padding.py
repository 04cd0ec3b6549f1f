"""The parity check on padded calls: padded rows left out, real tokens judged strictly.

A query with no real key to attend to (left padding under a causal mask, right padding
past a sliding window) gets whatever each kernel makes of a fully masked row:
transformers' eager and SDPA paths differ there by 0.1 while agreeing to 1e-7 on every
real token. Compared whole, every such batch reverted a correct swap.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import transformers
from torch import Tensor, nn

from lightning_speedkit import swap_attention
from lightning_speedkit.attention._input_copies import copy_inputs
from lightning_speedkit.attention._parity import Run, real_positions

# ------------------------------------------------------------------ which positions are real


def _forward(input_ids: Tensor, attention_mask: Tensor | None = None) -> None:
    """A call's signature: its mask may come by position."""


LEFT = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
REAL = LEFT.bool()


@pytest.mark.parametrize(
    "mask",
    [
        LEFT,  # the tokenizer's: 1 real, 0 padding
        LEFT.bool(),
        LEFT.float(),  # 1/0 weights
        (1.0 - LEFT.float()) * torch.finfo(torch.float32).min,  # additive: 0 attends
        torch.zeros(2, 4).masked_fill(LEFT == 0, -math.inf),
    ],
)
def test_a_2d_mask_names_the_real_tokens(mask: Tensor) -> None:
    ids = torch.zeros(2, 4, dtype=torch.long)
    real = real_positions(_forward, nn.Identity(), (ids,), {"attention_mask": mask})
    assert real is not None
    assert torch.equal(real, REAL)
    positional = real_positions(_forward, nn.Identity(), (ids, mask), {})
    assert positional is not None
    assert torch.equal(positional, REAL)
    anything = real_positions(
        lambda *args, **kwargs: None, nn.Identity(), (ids,), {"attention_mask": mask}
    )
    assert anything is not None
    assert torch.equal(anything, REAL)  # a forward taking **kwargs


def test_a_4d_mask_leaves_out_the_queries_no_key_can_reach() -> None:
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    allowed = causal & LEFT.bool()[:, None, None, :]  # (2, 1, 4, 4), left padding
    real = real_positions(_forward, nn.Identity(), (), {"attention_mask": allowed})
    assert real is not None
    assert torch.equal(real, REAL)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    real = real_positions(_forward, nn.Identity(), (), {"attention_mask": additive})
    assert real is not None
    assert torch.equal(real, REAL)
    right = causal & LEFT.flip(-1).bool()[:, None, None, :]  # right padding: causal rows reach
    assert real_positions(_forward, nn.Identity(), (), {"attention_mask": right}) is None


class _EncoderDecoder(nn.Module):
    config = transformers.PretrainedConfig(is_encoder_decoder=True)


@pytest.mark.parametrize(
    ("module", "kwargs"),
    [
        (nn.Identity(), {"attention_mask": torch.ones(2, 4)}),  # no padding
        (nn.Identity(), {"attention_mask": torch.zeros(2, 4)}),  # nothing real: compare all
        (nn.Identity(), {"attention_mask": torch.ones(2, 4, 4)}),  # 3-D: not a known layout
        (nn.Identity(), {"mask": LEFT}),  # another name: not known to mark padding
        (nn.Identity(), {"attention_mask": LEFT, "decoder_input_ids": LEFT}),
        (_EncoderDecoder(), {"attention_mask": LEFT}),  # the encoder's mask, decoder outputs
    ],
)
def test_calls_without_known_padding_are_compared_whole(
    module: nn.Module, kwargs: dict[str, Any]
) -> None:
    assert real_positions(lambda **kwargs: None, module, (), kwargs) is None


# ------------------------------------------------------------------ the measure


def _runs(change: Tensor, real: Tensor | None, loss: bool = False) -> float:
    """The error of a linear layer's run against itself with ``change`` added to its output."""
    torch.manual_seed(0)
    linear = nn.Linear(8, 8)
    x = torch.randn(2, 4, 8)
    inputs = copy_inputs((x,), {}, requires_grad=True)

    def forward(extra: Tensor) -> Any:
        out = linear(inputs[0][0]) + extra
        return (out.square().mean(), out) if loss else out

    own = Run(lambda: forward(torch.zeros(())), inputs, linear, grad=True, real=real)
    fused = Run(lambda: forward(change), inputs, linear, grad=True, real=real)
    return own.error(fused)


def test_padded_rows_are_left_out_and_real_rows_judged() -> None:
    padded = torch.zeros(2, 4, 8)
    padded[1, :2] = 0.5  # the padded positions' rows only
    real_row = torch.zeros(2, 4, 8)
    real_row[1, 3] = 1e-3  # one real token, a little off
    assert _runs(padded, REAL) == 0.0
    assert _runs(padded, None) > 0.1  # compared whole: the old verdict
    assert _runs(real_row, REAL) > 1e-4  # strict on real tokens


def test_a_gradient_through_padded_rows_only_is_left_out() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(8, 8)
    inputs = copy_inputs((torch.randn(2, 4, 8),), {}, requires_grad=True)

    def own() -> Tensor:
        return linear(inputs[0][0])

    def fused() -> Tensor:  # equal values; the padded rows' gradient to the weight doubled
        out = linear(inputs[0][0])
        twice = 2 * out - out.detach()
        return torch.where(REAL[..., None], out, twice)

    runs = [Run(f, inputs, linear, grad=True, real=REAL) for f in (own, fused)]
    assert runs[0].error(runs[1]) < 1e-6
    whole = [Run(f, inputs, linear, grad=True) for f in (own, fused)]
    assert whole[0].error(whole[1]) > 0.1


def test_a_loss_beside_per_token_outputs_is_left_out_only_on_padded_calls() -> None:
    # A Hugging Face loss on a left-padded row reads its last padded position's prediction
    # (the shifted labels ask it for the first real token): off wherever that row is.
    padded = torch.zeros(2, 4, 8)
    padded[1, 1] = 0.5
    assert _runs(padded, REAL, loss=True) == 0.0
    assert _runs(padded, None, loss=True) > 0.1
    real_row = torch.zeros(2, 4, 8)
    real_row[0, 0] = 1e-2
    assert _runs(real_row, REAL, loss=True) > 1e-4  # the logits show it


# ------------------------------------------------------------------ Hugging Face models


def _hf(family: str) -> tuple[nn.Module, Tensor]:
    """A tiny decoder with eager attention, and a padded mask whose padded queries see no
    real key: left padding, or right padding past the sliding window."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    mask = torch.ones(2, 16, dtype=torch.long)
    if family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
        mask[1, :5] = 0
    else:
        config = transformers.MistralConfig(**common, sliding_window=4)
        model = transformers.MistralForCausalLM(config)
        mask[1, 6:] = 0  # 10 padded positions, window 4
    return model, mask


def _logits(model: nn.Module, ids: Tensor, mask: Tensor, implementation: str) -> Tensor:
    model.config._attn_implementation = implementation  # type: ignore[union-attr]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    model.config._attn_implementation = "eager"  # type: ignore[union-attr]
    return logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", ["qwen2", "mistral_sliding_window"])
def test_a_padded_batch_keeps_a_hugging_face_sdpa_swap(family: str) -> None:
    model, mask = _hf(family)
    ids = torch.randint(1, 64, mask.shape, generator=torch.Generator().manual_seed(0))
    real = mask.bool()
    eager, sdpa = (_logits(model.eval(), ids, mask, impl) for impl in ("eager", "sdpa"))
    assert (eager - sdpa)[real].abs().max() < 1e-5  # transformers' two paths agree ...
    assert (eager - sdpa)[~real].abs().max() > 1e-3  # ... but on the padded queries
    labels = ids.masked_fill(~real, -100)
    sample = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    report = swap_attention(model.train(), "sdpa", sample=sample)
    entry = report.modules[0]
    assert (entry.status, entry.checked) == ("active", "forward+backward"), entry.reason
    assert entry.parity_error is not None
    assert entry.parity_error < 1e-5


def test_a_kernel_off_on_real_tokens_is_still_reverted_on_a_padded_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def off(*args: Any, **kwargs: Any) -> Tensor:  # 1e-3 off everywhere
        return sdpa(*args, **kwargs) * 1.001

    model, mask = _hf("qwen2")
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", off)
    ids = torch.randint(1, 64, mask.shape, generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "attention_mask": mask}
    with pytest.warns(UserWarning, match="parity error"):
        report = swap_attention(model, "sdpa", sample=sample)
    entry = report.modules[0]
    assert entry.status == "reverted"
    assert entry.parity_error is not None
    assert entry.parity_error > 1e-4


# ------------------------------------------------------------------ no family's names


class PaddedCausalAttention(nn.Module):
    """Attention no family names, taking the tokenizer's mask: found by tracing."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.h = heads
        self.a, self.b, self.c, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: Tensor, attention_mask: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = (p(x).view(B, N, self.h, -1).transpose(1, 2) for p in (self.a, self.b, self.c))
        scores = q @ k.transpose(-2, -1) / math.sqrt(C // self.h)
        causal = torch.ones(N, N, dtype=torch.bool).tril()
        allowed = causal & attention_mask[:, None, None, :].bool()
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, N, C))


def test_a_traced_attention_with_a_left_padded_mask_is_swapped() -> None:
    torch.manual_seed(0)
    module = PaddedCausalAttention()
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0
    report = swap_attention(
        module, "sdpa", sample={"x": torch.randn(2, 16, 32), "attention_mask": mask}
    )
    entry = report.modules[0]
    assert (entry.family, entry.status) == ("traced", "active"), entry.reason
    assert entry.parity_error is not None
    assert entry.parity_error < 1e-5
