"""swap_attention: each family swapped with equal outputs and gradients, look-alikes reverted."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_speedkit import SpeedkitConfigError, count_flops, swap_attention
from lightning_speedkit.attention._discovery import _PROBED, probed
from lightning_speedkit.attention.swap import SwapReport, _TracedSwaps, swapped_modules
from speedkit_examples.vlm import VLM, VLMConfig

from .test_auto_keeps_own import rig_auto_timing
from .test_traced import Block, CrossAttention, ViTAttention


def _vlm(preset: str = "tiny") -> VLM:
    torch.manual_seed(0)
    return VLM(VLMConfig.preset(preset, vocab_size=35))  # type: ignore[arg-type]


def _vlm_inputs(batch: int = 3, text: int = 20) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, 32, 32, generator=generator)
    return images, torch.randint(0, 35, (batch, text), generator=generator)


def _outputs_and_grads(model: nn.Module, *inputs: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The output and every parameter's gradient under a fixed projection of it."""
    model.zero_grad()
    out = model(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * weight).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _assert_same_numbers(swapped: nn.Module, reference: nn.Module, *inputs: Tensor) -> None:
    out, grads = _outputs_and_grads(swapped, *inputs)
    ref_out, ref_grads = _outputs_and_grads(reference, *inputs)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


# ------------------------------------------------------------------ structural


def test_example_vlm_attention_is_found_by_structure_and_matches() -> None:
    model, reference = _vlm(), _vlm()
    report = swap_attention(model, "sdpa", sample=_vlm_inputs())
    assert report.swapped == [
        "vision.blocks.0.attn",
        "vision.blocks.1.attn",
        "language_model.blocks.0.attn",
        "language_model.blocks.1.attn",
    ]
    assert {m.family for m in report.modules} == {"structural"}
    assert all(m.checked == "forward+backward" for m in report.modules)
    assert all(m.parity_error is not None and m.parity_error < 1e-5 for m in report.modules)
    assert model.state_dict().keys() == reference.state_dict().keys()
    _assert_same_numbers(model, reference, *_vlm_inputs(batch=2, text=31))


def test_swapped_modules_really_run_sdpa_and_not_softmax() -> None:
    model = _vlm()
    swap_attention(model, "sdpa", sample=_vlm_inputs())
    counts = count_flops(model, *_vlm_inputs()).by_operator
    assert any("scaled_dot_product" in op for op in counts)  # the fused kernel ran
    assert not any(op == "aten.bmm" for op in counts)  # eager attention's score matmuls are gone


def test_causal_mask_buffer_makes_the_fused_attention_causal() -> None:
    attention = _vlm().language_model.blocks[0].attn
    reference = copy.deepcopy(attention)
    swap_attention(attention, "sdpa", sample=torch.randn(2, 9, 64))
    x = torch.randn(2, 9, 64)
    changed = x.clone()
    changed[:, -1] += 1.0  # a causal layer's earlier outputs ignore the last token
    torch.testing.assert_close(attention(x)[:, :-1], attention(changed)[:, :-1])
    torch.testing.assert_close(attention(x), reference(x), rtol=1e-5, atol=1e-6)


class HeadMixingAttention(nn.Module):
    """Looks like attention (q/k/v/o projections, heads) but mixes heads after the softmax."""

    def __init__(self, dim: int = 32, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.o_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = (
            p(x).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        weights = (q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)).softmax(-1)
        weights = weights.mean(dim=1, keepdim=True).expand_as(weights)  # heads mixed
        return self.o_proj((weights @ v).transpose(1, 2).reshape(B, N, C))


@pytest.mark.parametrize("with_sample", [True, False])
def test_look_alike_that_is_not_equivalent_fails_parity_and_keeps_its_forward(
    with_sample: bool,
) -> None:
    module = HeadMixingAttention()
    x = torch.randn(2, 6, 32)
    expected = module(x)
    with pytest.warns(UserWarning, match="kept .* own attention .* parity error"):
        report = swap_attention(module, "sdpa", sample=x if with_sample else None)
    assert report.swapped == []
    ((name, reason),) = report.reverted
    assert name == ""
    assert "parity error" in reason
    assert "forward" not in module.__dict__  # the class's own forward again
    torch.testing.assert_close(module(x), expected)


def test_half_precision_is_judged_against_float32_not_against_eager() -> None:
    """Sharp attention in bf16: eager's own rounding is far from the float32 function
    (its scores are rounded before the softmax), the fused kernel much less so. Judged
    against eager the swap would fail (7e-2 > 3e-2); against float32 it passes, and its
    reported error is the fused kernel's distance from float32."""
    from speedkit_examples.vlm.model import VisionSelfAttention

    torch.manual_seed(0)
    module = VisionSelfAttention(64, 4).to(torch.bfloat16)
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    x = (torch.randn(2, 128, 64) * 8).bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no revert warning
        report = swap_attention(module, "sdpa", sample=x)
    (entry,) = report.modules
    assert entry.status == "active"
    assert entry.parity_error is not None
    assert 3e-2 < entry.parity_error < 6e-2
    for key, value in module.state_dict().items():  # the float32 run left them as they were
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, weights[key])


def test_half_precision_look_alike_is_still_reverted() -> None:
    module = HeadMixingAttention().to(torch.bfloat16)
    with pytest.warns(UserWarning, match="kept .* own attention .* parity error"):
        report = swap_attention(module, "sdpa", sample=torch.randn(2, 6, 32).bfloat16())
    assert report.swapped == []


def _parameter_grads(module: nn.Module, x: Tensor, dtype: torch.dtype | None) -> dict[str, Tensor]:
    module.zero_grad()
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        out = module(x)
    (
        out.float() * torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    ).sum().backward()
    return {n: p.grad.float().clone() for n, p in module.named_parameters() if p.grad is not None}


def test_bf16_causal_decoder_at_initialisation_keeps_its_fused_kernel() -> None:
    """Issue 19. At initialisation the decoder's hidden states are nearly collinear (the
    example VLM's: mean cosine 0.98), its attention nearly uniform, and the query and key
    projections' gradients hundreds of times smaller than the value and output
    projections'. A fused kernel's bf16 backward (FlashAttention's row sums from the
    rounded output; PyTorch's CPU flash kernel too) puts an error of tens of percent of
    their own size on them. Judged per tensor, separate ``q_proj``/``k_proj`` failed (here
    5-9e-2 > 3e-2; 0.10-0.21 on the VLM ``base`` on an H100 and on CPU) while a fused
    ``qkv`` hid the same error beside its value part. The module's whole parameter gradient
    has the error of the module's own bf16 attention with every kernel: it now passes."""
    from speedkit_examples.vlm.model import CausalSelfAttention

    torch.manual_seed(0)
    module = CausalSelfAttention(512, 8, max_len=64)
    for linear in (module.q_proj, module.k_proj, module.v_proj, module.o_proj):
        nn.init.normal_(linear.weight, std=0.02)  # the example VLM's initialisation
        nn.init.zeros_(linear.bias)
    reference = copy.deepcopy(module)
    generator = torch.Generator().manual_seed(0)
    common = torch.randn(512, generator=generator)
    spread = torch.randn(2, 64, 4, generator=generator) @ torch.randn(4, 512, generator=generator)
    x = F.layer_norm(common + spread / 16, (512,))  # collinear tokens, a few directions apart
    with torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.simplefilter("error")  # no revert
        report = swap_attention(module, "sdpa", sample=x)
    (entry,) = report.modules
    assert entry.status == "active"
    assert entry.parity_error is not None
    assert entry.parity_error < 1e-2
    # The regime of the issue: per tensor, the fused kernel's q_proj gradient is far off,
    # and further than the module's own bf16 attention's...
    grads = {
        "fused": _parameter_grads(module, x, torch.bfloat16),
        "own": _parameter_grads(reference, x, torch.bfloat16),
        "exact": _parameter_grads(reference, x, None),
    }
    exact = grads["exact"]["q_proj.weight"]
    q_error = {
        k: float((g["q_proj.weight"] - exact).abs().max() / exact.abs().max())
        for k, g in grads.items()
    }
    assert q_error["fused"] > max(0.1, 2 * q_error["own"])
    # ...while the whole gradient is as close to float32 as the module's own bf16 attention.
    flat = {k: torch.cat([g[n].flatten() for n in sorted(g)]) for k, g in grads.items()}
    error = {k: float((v - flat["exact"]).norm() / flat["exact"].norm()) for k, v in flat.items()}
    assert error["fused"] < 1.1 * error["own"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn", "auto"])
def test_bf16_causal_decoder_on_cuda_keeps_each_fused_kernel(backend: str) -> None:
    """The H100 failure of issue 19 (every kernel reverted on the VLM ``base`` decoder at
    0.10-0.21): its regime, the decoder's width and collinear hidden states, on CUDA under
    bf16 autocast. Each of SDPA's CUDA kernels must now pass and stay swapped."""
    from speedkit_examples.vlm.model import CausalSelfAttention

    torch.manual_seed(0)
    module = CausalSelfAttention(1024, 16, max_len=260).cuda()
    for linear in (module.q_proj, module.k_proj, module.v_proj, module.o_proj):
        nn.init.normal_(linear.weight, std=0.02)  # the example VLM's initialisation
        nn.init.zeros_(linear.bias)
    generator = torch.Generator().manual_seed(0)
    common = torch.randn(1024, generator=generator)
    spread = torch.randn(8, 259, 4, generator=generator) @ torch.randn(4, 1024, generator=generator)
    x = F.layer_norm(common + spread / 16, (1024,)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        report = swap_attention(module, backend, sample=x)
    (entry,) = report.modules
    assert entry.status == "active", entry.reason  # not reverted
    assert entry.checked == "forward+backward"


@pytest.mark.gpu
def test_example_vlm_in_bf16_on_cuda_swaps_every_attention_module() -> None:
    """The GPU regime: auto picks among SDPA's CUDA kernels and none is reverted."""
    torch.manual_seed(0)
    config = VLMConfig.preset("small", vocab_size=35, image_size=128)  # type: ignore[arg-type]
    model = VLM(config).cuda().bfloat16()
    images = torch.randn(8, 3, 128, 128, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 35, (8, config.max_text_len - 1), device="cuda")
    report = swap_attention(model, "auto", sample=(images, ids))
    assert report.reverted == []
    assert len(report.swapped) == config.vision_depth + config.text_depth


class GroupedQueryAttention(nn.Module):
    """Causal GQA with a nanoGPT-style float mask buffer of shape (1, 1, T, T) and dropout."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2, max_len: int = 16) -> None:
        super().__init__()
        self.n_head, self.n_kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.attn_dropout = nn.Dropout(0.1)
        self.register_buffer(
            "bias", torch.tril(torch.ones(max_len, max_len)).view(1, 1, max_len, max_len)
        )

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q = self.wq(x).view(B, N, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, N, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, N, self.n_kv_heads, self.head_dim).transpose(1, 2)
        groups = self.n_head // self.n_kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(self.bias[:, :, :N, :N] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        return self.wo((att @ v).transpose(1, 2).reshape(B, N, C))


def test_grouped_query_attention_with_float_mask_and_dropout_is_swapped() -> None:
    module = GroupedQueryAttention().eval()
    reference = copy.deepcopy(module)
    report = swap_attention(module, "sdpa")
    assert report.swapped == [""]
    assert report.modules[0].checked == "synthetic"
    _assert_same_numbers(module, reference, torch.randn(3, 12, 32))


def test_calls_the_structure_does_not_cover_run_the_modules_own_forward() -> None:
    attention = _vlm().language_model.blocks[0].attn
    swap_attention(attention, "sdpa")
    too_long = torch.randn(1, attention.causal_mask.shape[0] + 1, 64)
    with pytest.raises(RuntimeError):  # the module's own forward: its mask is too short
        attention(too_long)


def test_nothing_matched_warns_with_the_way_out() -> None:
    with pytest.warns(UserWarning, match="found no attention module.*register_adapter"):
        report = swap_attention(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), sample=torch.ones(1, 4))
    assert report.swapped == []
    assert report.skipped == []


def test_without_a_sample_nothing_matched_warns_at_the_first_call() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the model has not run: nothing is known yet
        report = swap_attention(model)
    with pytest.warns(UserWarning, match="found no attention module in Sequential"):
        model(torch.ones(1, 4))
    assert report.modules == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once; the probes are gone
        model(torch.ones(1, 4))


def test_optimizer_built_before_the_swap_still_trains_the_same_parameters() -> None:
    model, reference = _vlm(), _vlm()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference)]
    swap_attention(model, "sdpa", sample=_vlm_inputs())
    for m, optimizer in zip((model, reference), optimizers, strict=True):
        _outputs_and_grads(m, *_vlm_inputs())
        optimizer.step()
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(next(model.parameters()), next(_vlm().parameters()))  # it moved


def test_swapped_model_compiles_and_matches() -> None:
    model, reference = _vlm(), _vlm()
    swap_attention(model, "sdpa", sample=_vlm_inputs())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=False)
    inputs = _vlm_inputs(batch=2, text=12)
    torch.testing.assert_close(compiled(*inputs), reference(*inputs), rtol=1e-5, atol=1e-5)


def test_parity_check_is_not_counted_as_model_flops() -> None:
    model = _vlm()
    swap_attention(model, "sdpa")  # synthetic checks only: the first real call checks again
    first = count_flops(model, *_vlm_inputs())
    second = count_flops(model, *_vlm_inputs())
    assert first.total == second.total


def test_state_dict_loads_into_the_unswapped_model() -> None:
    model, other = _vlm(), VLM(VLMConfig.preset("tiny", vocab_size=35))
    swap_attention(model, "sdpa")
    other.load_state_dict(model.state_dict())
    inputs = _vlm_inputs()
    torch.testing.assert_close(model(*inputs), other(*inputs), rtol=1e-5, atol=1e-5)


def test_second_swap_skips_what_is_swapped_already() -> None:
    model = _vlm()
    swap_attention(model, "sdpa")
    again = swap_attention(model, "math")
    assert again.swapped == []
    assert {reason for _, reason in again.skipped} == {"already swapped"}
    assert len(swapped_modules(model)) == 4


def test_auto_picks_a_passing_backend_and_reports_its_speedup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig_auto_timing(monkeypatch, own=3.0, fused=2.0)  # tiny blocks time by noise otherwise
    model = _vlm()
    report = swap_attention(model, "auto", sample=_vlm_inputs())
    for m in report.modules:
        assert m.status == "active"
        assert m.backend in ("sdpa", "flash", "math")
        assert m.speedup == pytest.approx(1.5)
    assert "| vision.blocks.0.attn | structural |" in report.to_markdown()


def test_auto_times_its_candidates_even_without_measure() -> None:
    report = swap_attention(_vlm(), "auto", sample=_vlm_inputs(), measure=False)
    assert all(m.speedup is not None for m in report.modules)  # picked by timing, not first


def test_bad_input_is_refused_with_the_fix() -> None:
    with pytest.raises(SpeedkitConfigError, match=r"`backend='fast'`.*Choose one of"):
        swap_attention(_vlm(), "fast")  # type: ignore[arg-type]
    with pytest.raises(SpeedkitConfigError, match="`sample` must be a tensor"):
        swap_attention(_vlm(), sample=[torch.zeros(1)])
    with pytest.raises(SpeedkitConfigError, match=r"already wrapped by torch\.compile.*before"):
        swap_attention(torch.compile(_vlm()))
    with pytest.raises(
        SpeedkitConfigError, match=r"`tolerance` must be a positive number, got 0\.0"
    ):
        swap_attention(_vlm(), tolerance=0.0)


# ---------------------------------------------------------- nn.MultiheadAttention


@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_layer_multihead_attention_is_swapped(batch_first: bool) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        16, 2, dim_feedforward=32, dropout=0.0, batch_first=batch_first
    )
    reference = copy.deepcopy(layer)
    x = torch.randn(2, 7, 16) if batch_first else torch.randn(7, 2, 16)
    report = swap_attention(layer, "math", sample=x)
    assert report.swapped == ["self_attn"]
    assert report.modules[0].family == "multihead_attention"
    _assert_same_numbers(layer, reference, x)


def test_multihead_attention_calls_asking_for_weights_still_get_them() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    reference = copy.deepcopy(mha)
    x = torch.randn(2, 5, 16)
    swap_attention(mha, "sdpa", sample=(x, x, x, None, False))
    out, weights = mha(x, x, x)  # need_weights defaults to True
    ref_out, ref_weights = reference(x, x, x)
    assert weights is not None
    torch.testing.assert_close(weights, ref_weights)
    torch.testing.assert_close(out, ref_out)


# ---------------------------------------------------------------- timm-style switch


class TimmStyleAttention(nn.Module):
    """The shape of timm's ``Attention``: a ``fused_attn`` switch between SDPA and eager.

    timm itself needs torchvision, which has no build for this CPU torch; on
    machines with timm, ``test_timm_vision_transformer`` runs the real one.
    """

    def __init__(self, dim: int = 32, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn = False
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.seen_fused: list[bool] = []

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        self.seen_fused.append(self.fused_attn)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            x = (q * self.scale @ k.transpose(-2, -1)).softmax(dim=-1) @ v
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


def test_modules_with_a_fused_attn_switch_run_fused_and_keep_the_switch() -> None:
    module = TimmStyleAttention()
    reference = copy.deepcopy(module)
    report = swap_attention(module, "flash")
    assert report.swapped == [""]
    assert report.modules[0].family == "timm"
    x = torch.randn(2, 10, 32)
    module.seen_fused.clear()
    _assert_same_numbers(module, reference, x)  # the first real call is checked...
    assert module.seen_fused[:2] == [False, True]  # own, then fused, on a copy of the input
    module.seen_fused.clear()
    _assert_same_numbers(module, reference, x)  # ...and from then on runs fused only
    assert module.seen_fused == [True]
    assert module.fused_attn is False


def test_timm_vision_transformer() -> None:
    timm = pytest.importorskip(
        "timm", reason="timm needs torchvision, not installable beside CPU torch 2.13"
    )
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8)
    for block in model.blocks:
        block.attn.fused_attn = False
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 32, 32)
    report = swap_attention(model, "sdpa", sample=x)
    assert len(report.swapped) == len(model.blocks)
    _assert_same_numbers(model, reference, x)


# ----------------------------------------------------------------- Hugging Face


def _llama(**overrides: Any) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
        **overrides,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class _Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(ids).logits  # type: ignore[no-any-return]


def test_hugging_face_model_switches_to_sdpa_per_call_and_matches() -> None:
    model = _llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    report = swap_attention(model, "sdpa", sample=(ids,))
    assert report.swapped == [""]
    assert report.modules[0].family == "huggingface"
    assert report.modules[0].checked == "forward+backward"
    _assert_same_numbers(_Logits(model), _Logits(reference), ids)
    assert model.config._attn_implementation == "eager"  # switched for the call only


def test_a_backend_that_cannot_run_the_training_call_is_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The check compares in eval mode (no dropout). The CPU's flash kernel has no dropout:
    # it passed there, then every training call raised "No available kernel".
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    model = _llama(attention_dropout=0.1).train()
    report = swap_attention(model, "flash")
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match="cannot run the training call"):
        loss = model(ids, labels=ids).loss
    loss.backward()  # trains: the module's own attention
    assert report.modules[0].status == "reverted"
    assert "backend 'flash' cannot run the training call" in report.modules[0].reason
    auto = _llama(attention_dropout=0.1).train()
    rig_auto_timing(monkeypatch, own=2.0, fused=1.0)  # swapped, not kept as its own by noise
    report = swap_attention(auto, "auto")
    # The first call checks (and runs each passing backend once in training modes), the
    # second only trains: both must draw the same random numbers, the trial runs none.
    drawn = []
    for _ in range(2):
        torch.manual_seed(1)
        first = auto(ids, labels=ids).loss
        drawn.append((torch.get_rng_state(), float(first)))
    assert report.modules[0].status == "active"
    assert report.modules[0].backend != "flash"
    assert torch.equal(drawn[0][0], drawn[1][0])
    assert drawn[0][1] == pytest.approx(drawn[1][1], rel=1e-6)  # the same dropout masks


def test_hugging_face_calls_asking_for_attentions_get_them() -> None:
    model = _llama()
    swap_attention(model, "sdpa")
    ids = torch.randint(0, 50, (1, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(ids, output_attentions=True)
    assert out.attentions is not None
    assert len(out.attentions) == 2
    assert out.attentions[0].shape == (1, 4, 6, 6)


def test_hugging_face_tower_without_sdpa_keeps_its_attention_the_rest_is_swapped() -> None:
    transformers = pytest.importorskip("transformers")

    class NoSdpaTower(transformers.LlamaModel):  # a tower transformers has no SDPA for
        _supports_sdpa = False

    class TwoTower(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.language = _llama()
            config = copy.deepcopy(self.language.config)
            self.vision = NoSdpaTower(config)

    report = swap_attention(TwoTower(), "sdpa")
    assert report.swapped == ["language"]
    assert report.skipped == [("vision", "NoSdpaTower has no SDPA attention in transformers")]


def test_a_swapped_task_with_metrics_deep_copies_and_the_copy_computes_the_same() -> None:
    """copy.deepcopy of a model (an EMA copy, a benchmark's variants) whose swap still
    probes modules not called yet: here the task's torchmetrics metrics, whose hash reads
    a state that a half-made copy lacks. The copy failed with an AttributeError."""
    from speedkit_examples.vlm import CaptionTokenizer, VLMTask

    tokenizer = CaptionTokenizer()
    torch.manual_seed(0)
    task = VLMTask(VLMConfig.preset("tiny", tokenizer.vocab_size), pad_id=tokenizer.pad_id)
    images = torch.randn(2, 3, task.model.config.image_size, task.model.config.image_size)
    ids = torch.randint(0, tokenizer.vocab_size, (2, 8))
    report = swap_attention(task, "sdpa", sample=(images, ids))
    assert report.swapped
    copied = copy.deepcopy(task)
    assert list(swapped_modules(copied)) == list(swapped_modules(task))
    torch.testing.assert_close(copied.model(images, ids), task.model(images, ids), rtol=0, atol=0)
    # The copy's metrics are probed by the copy's discovery: tracing one there (no
    # attention in it) decides it in the copy alone.
    before = report.as_dict()
    assert probed(copied.val_acc)
    assert probed(task.val_acc)
    logits = torch.randn(6, tokenizer.vocab_size, generator=torch.Generator().manual_seed(0))
    copied.val_acc(logits, torch.randint(0, tokenizer.vocab_size, (6,)))
    assert not probed(copied.val_acc)
    assert probed(task.val_acc)
    assert report.as_dict() == before


# ------------------------------------------------------------------ deep copies


class _LateAttention(nn.Module):
    """A sample reaches one attention; the other is first called later (with ``extra``).
    The torchmetrics metric (its hash reads its state, its ``==`` is always true) is never
    called: it stays probed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.common = Block(ViTAttention())
        self.late = Block(CrossAttention())
        self.metric = pytest.importorskip("torchmetrics").MeanMetric()

    def forward(self, x: Tensor, extra: Tensor | None = None) -> Tensor:
        out = self.common(x)
        return out if extra is None else out + self.late(extra)  # type: ignore[no-any-return]


def _late_inputs() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2, 7, 32, generator=generator), torch.randn(2, 7, 32, generator=generator)


def _discovered_into(module: nn.Module) -> SwapReport:
    """The report the discovery probing ``module`` records into."""
    traced = _PROBED[id(module)].installer
    assert isinstance(traced, _TracedSwaps)
    return traced.report


LATE_DETAIL = "4 heads, q/k/v to_q/to_k/to_v, out to_out.0"


def test_a_deep_copy_swaps_its_late_attention_in_itself_and_reports_it_in_its_own_report() -> None:
    """A module first called on a deep copy (an EMA copy, a teacher) was swapped in the
    copy but recorded in the original's report, its detail naming the original's
    parameters. Each model now finds, swaps and reports its own."""
    model = _LateAttention()
    reference = copy.deepcopy(model)  # eager
    x, extra = _late_inputs()
    report = swap_attention(model, "sdpa", sample=(x,))
    assert report.swapped == ["common.attention"]
    before, entries = report.as_dict(), list(report.modules)
    copied = copy.deepcopy(model)
    assert probed(copied.late)
    assert probed(copied.metric)
    copied_report = _discovered_into(copied.late)
    assert copied_report is not report
    for _ in range(2):  # traced, found and checked; then the fused forward
        _assert_same_numbers(copied, reference, x, extra)
    # The original: its report, its swaps and its probes as they were.
    assert report.as_dict() == before
    assert len(report.modules) == 1
    assert report.modules[0] is entries[0]
    assert list(report._swaps) == ["common.attention"]
    assert list(swapped_modules(model)) == ["common.attention"]
    assert probed(model.late)
    # The copy: its late attention swapped, checked, named after its own parameters...
    copied_swaps = swapped_modules(copied)
    assert list(copied_swaps) == ["common.attention", "late.attention"]
    late = copied_swaps["late.attention"].entry
    assert (late.family, late.status, late.checked) == ("traced", "active", "forward+backward")
    assert late.parity_error is not None
    assert late.parity_error < 1e-5
    assert late.detail == LATE_DETAIL
    # ...and recorded in the copy's report, whose entries are the copy's swaps'.
    assert copied_report.swapped == ["common.attention", "late.attention"]
    assert [m.name for m in copied_report.modules] == list(copied_swaps)
    for entry, swap in zip(copied_report.modules, copied_swaps.values(), strict=True):
        assert entry is swap.entry
    assert copied_report.modules[0] is not entries[0]
    # The original's own late call finds its own, and leaves the copy's report alone.
    _assert_same_numbers(model, reference, x, extra)
    assert report.swapped == ["common.attention", "late.attention"]
    assert report.modules[1].detail == LATE_DETAIL
    assert report.modules[1] is not late
    assert len(copied_report.modules) == 2
    assert copied_report.modules[1] is late
    assert probed(model.metric)
    assert probed(copied.metric)


def test_an_averaged_model_of_a_swap_without_sample_swaps_its_copy_apart() -> None:
    """AttentionSwap's case (no sample: every traced module waits for the first call)
    under ``AveragedModel`` (EMA weights), which deep-copies the model at once."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = _LateAttention()
    reference = copy.deepcopy(model)
    report = swap_attention(model, "sdpa")
    assert report.modules == []
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    x, extra = _late_inputs()
    averaged.update_parameters(model)
    with torch.no_grad():  # training moves the model; the average follows part of the way
        for p in (*model.parameters(), *reference.parameters()):
            p.add_(0.01)
    averaged.update_parameters(model)
    plain = copy.deepcopy(reference)
    plain.load_state_dict(averaged.module.state_dict())
    assert not torch.equal(plain.common.mlp[0].weight, model.common.mlp[0].weight)
    out = averaged(x, extra)  # the copy's first call: traced, found, checked in the copy
    torch.testing.assert_close(out, plain(x, extra), rtol=1e-5, atol=1e-5)
    _assert_same_numbers(averaged.module, plain, x, extra)
    assert report.modules == []  # the original has not run: nothing found in it
    assert list(swapped_modules(averaged)) == ["module.common.attention", "module.late.attention"]
    assert all(s.entry.status == "active" for s in swapped_modules(averaged).values())
    _assert_same_numbers(model, reference, x, extra)  # the original's first call
    assert report.swapped == ["common.attention", "late.attention"]
    copied_entries = [s.entry for s in swapped_modules(averaged).values()]
    assert not any(e is c for e in report.modules for c in copied_entries)


def test_auto_times_each_kind_of_call_once_and_its_modules_share_the_pick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Timing noise once gave a model's 28 like blocks four different backends on a GPU;
    # compiled, each backend is one more graph of the block, past dynamo's recompile limit.
    from lightning_speedkit.attention import _swapped_forward

    timed: list[str] = []

    def fake_pick(own: Any, passing: Any, **_: Any) -> tuple[str, float, float]:
        backend, error, _run = passing[len(timed) % len(passing)]  # differs on every call
        timed.append(backend)
        return backend, error, 1.5 + len(timed)

    monkeypatch.setattr(_swapped_forward, "pick_fastest", fake_pick)
    model = _vlm()  # two vision and two decoder blocks
    report = swap_attention(model, "auto", sample=_vlm_inputs())
    by_class: dict[str, set[tuple[str | None, float | None]]] = {}
    for m in report.modules:
        owner = type(model.get_submodule(m.name)).__name__
        by_class.setdefault(owner, set()).add((m.backend, m.speedup))
    assert len(report.modules) == 4
    assert len(timed) == len(by_class) == 2  # once per attention class, not once per module
    assert all(len(picks) == 1 for picks in by_class.values()), by_class


def test_auto_times_a_module_again_when_the_shared_pick_fails_its_parity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_speedkit.attention import _swapped_forward

    rig_auto_timing(monkeypatch, own=2.0, fused=1.0)  # each timing swaps: none by noise
    model = _vlm()
    calls: list[list[str]] = []
    real = _swapped_forward.pick_fastest

    def spy(own: Any, passing: Any, **kw: Any) -> Any:
        calls.append([backend for backend, _, _ in passing])
        return real(own, passing, **kw)

    monkeypatch.setattr(_swapped_forward, "pick_fastest", spy)
    report = swap_attention(model, "auto", sample=_vlm_inputs())
    kinds = dict(report._auto_picks)
    assert len(kinds) == 2
    assert len(calls) == 2
    # A pick no later module of its kind can run: the next such module is timed anew.
    for kind in kinds:
        report._auto_picks[kind] = ("no-such-backend", None)
    for swap in report._swaps.values():
        swap.checked_forward = swap.checked_backward = False
    images, ids = _vlm_inputs()
    model(images, ids)
    assert len(calls) == 4  # one new timing per kind; its later modules take that
    assert {b for b, _ in report._auto_picks.values()} != {"no-such-backend"}
