"""The traced family: attention found by what a module computes, written as research code writes it.

The modules below are written the way their repositories write them (diffusers' old
``CrossAttention``, vit-pytorch's and imagen-pytorch's ``Attention``), with einops'
``rearrange`` spelled out in torch; none of their attribute names is one the
structural adapter knows.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_speedkit import count_flops, swap_attention
from lightning_speedkit.attention.swap import swapped_modules


class ViTAttention(nn.Module):
    """vit-pytorch's ``Attention``, einsum era: ``to_qkv`` chunked, ``to_out`` a Sequential."""

    def __init__(self, dim: int = 32, heads: int = 4, dim_head: int = 8, dropout: float = 0.0):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.scale = dim_head**-0.5
        self.attend = nn.Softmax(dim=-1)
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim), nn.Dropout(dropout))

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        qkv = self.to_qkv(x).chunk(3, dim=-1)
        # rearrange(t, 'b n (h d) -> b h n d', h=h)
        q, k, v = (t.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) for t in qkv)
        dots = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        attn = self.attend(dots)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out.permute(0, 2, 1, 3).reshape(b, n, -1)  # rearrange(out, 'b h n d -> b n (h d)')
        return self.to_out(out)  # type: ignore[no-any-return]


class CrossAttention(nn.Module):
    """diffusers' old ``CrossAttention``: heads folded into the batch, ``baddbmm`` and ``bmm``."""

    def __init__(
        self, query_dim: int = 32, context_dim: int | None = None, heads: int = 4, dim_head: int = 8
    ):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = context_dim if context_dim is not None else query_dim
        self.scale = dim_head**-0.5
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(0.0))

    def reshape_heads_to_batch_dim(self, tensor: Tensor) -> Tensor:
        batch_size, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size, seq_len, self.heads, dim // self.heads)
        return tensor.permute(0, 2, 1, 3).reshape(batch_size * self.heads, seq_len, -1)

    def reshape_batch_dim_to_heads(self, tensor: Tensor) -> Tensor:
        batch_size, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size // self.heads, self.heads, seq_len, dim)
        return tensor.permute(0, 2, 1, 3).reshape(batch_size // self.heads, seq_len, -1)

    def forward(
        self, hidden_states: Tensor, context: Tensor | None = None, mask: Tensor | None = None
    ) -> Tensor:
        query = self.to_q(hidden_states)
        context = context if context is not None else hidden_states
        key, value = self.to_k(context), self.to_v(context)
        query, key, value = map(self.reshape_heads_to_batch_dim, (query, key, value))
        empty = torch.empty(query.shape[0], query.shape[1], key.shape[1], dtype=query.dtype)
        scores = torch.baddbmm(empty, query, key.transpose(-1, -2), beta=0, alpha=self.scale)
        probs = scores.softmax(dim=-1)
        hidden_states = self.reshape_batch_dim_to_heads(torch.bmm(probs, value))
        hidden_states = self.to_out[0](hidden_states)
        return self.to_out[1](hidden_states)  # type: ignore[no-any-return]


class ImagenAttention(nn.Module):
    """imagen-pytorch's ``Attention``: one key/value head, a learned null key/value, a
    key-padding ``mask``, an optional causal mask, a stabilised float32 softmax."""

    def __init__(self, dim: int = 32, dim_head: int = 8, heads: int = 4, causal: bool = False):
        super().__init__()
        self.scale, self.heads, self.causal = dim_head**-0.5, heads, causal
        self.norm = nn.LayerNorm(dim)
        self.null_kv = nn.Parameter(torch.randn(2, dim_head))
        self.to_q = nn.Linear(dim, dim_head * heads, bias=False)
        self.to_kv = nn.Linear(dim, dim_head * 2, bias=False)
        self.to_out = nn.Sequential(nn.Linear(dim_head * heads, dim, bias=False), nn.LayerNorm(dim))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b, n, _ = x.shape
        x = self.norm(x)
        q, k, v = (self.to_q(x), *self.to_kv(x).chunk(2, dim=-1))
        q = q.reshape(b, n, self.heads, -1).permute(0, 2, 1, 3) * self.scale
        nk, nv = (t.reshape(1, 1, -1).expand(b, 1, -1) for t in self.null_kv.unbind(dim=-2))
        k, v = torch.cat((nk, k), dim=-2), torch.cat((nv, v), dim=-2)
        sim = torch.einsum("b h i d, b j d -> b h i j", q, k)
        max_neg_value = -torch.finfo(sim.dtype).max
        if mask is not None:
            mask = F.pad(mask, (1, 0), value=True)[:, None, None, :]
            sim = sim.masked_fill(~mask, max_neg_value)
        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, max_neg_value)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1, dtype=torch.float32).to(sim.dtype)
        out = torch.einsum("b h i j, b j d -> b h i d", attn, v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, -1))  # type: ignore[no-any-return]


class GPTAttention(nn.Module):
    """Causal attention with a triangular buffer under a name of its own, and dropout."""

    def __init__(self, dim: int = 32, n_heads_total: int = 4, block: int = 16, p: float = 0.0):
        super().__init__()
        self.h = n_heads_total
        self.c_qkv = nn.Linear(dim, 3 * dim)
        self.c_o = nn.Linear(dim, dim)
        self.drop = nn.Dropout(p)
        self.register_buffer("tri", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.tri[:, :, :T, :T] == 0, float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        return self.c_o((att @ v).transpose(1, 2).contiguous().view(B, T, C))  # type: ignore[no-any-return]


class Mixture(nn.Module):
    """A softmax gate over experts: a softmax and a product, but not attention."""

    def __init__(self, dim: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x: Tensor) -> Tensor:
        weights = self.gate(x).softmax(dim=-1)  # (b, n, e)
        outputs = torch.stack([expert(x) for expert in self.experts], dim=-2)  # (b, n, e, d)
        return torch.einsum("b n e, b n e d -> b n d", weights, outputs)


class HeadAveragedAttention(nn.Module):
    """Attention whose weights are averaged over heads after the softmax: not SDPA's."""

    def __init__(self, dim: int = 32, groups: int = 4) -> None:
        super().__init__()
        self.groups = groups
        self.inp = nn.Linear(dim, 3 * dim)
        self.outp = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.inp(x).view(b, n, 3, self.groups, -1).permute(2, 0, 3, 1, 4)
        weights = (q @ k.transpose(-1, -2) / math.sqrt(c // self.groups)).softmax(-1)
        weights = weights.mean(dim=1, keepdim=True).expand_as(weights)
        return self.outp((weights @ v).transpose(1, 2).reshape(b, n, c))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, attention: nn.Module, dim: int = 32) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = attention
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _call(module: nn.Module, sample: Any) -> Tensor:
    if isinstance(sample, dict):
        return module(**sample)  # type: ignore[no-any-return]
    return module(*sample) if isinstance(sample, tuple) else module(sample)  # type: ignore[no-any-return]


def _outputs_and_grads(module: nn.Module, sample: Any) -> tuple[Tensor, dict[str, Tensor]]:
    module.zero_grad()
    out = _call(module, sample)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _assert_same_numbers(swapped: nn.Module, reference: nn.Module, sample: Any) -> None:
    out, grads = _outputs_and_grads(swapped, sample)
    ref_out, ref_grads = _outputs_and_grads(reference, sample)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def _x(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


CASES = {
    "vit_einsum": (
        lambda: ViTAttention(),
        lambda: _x(2, 7, 32),
        "4 heads, q/k/v to_qkv, out to_out.0",
    ),
    "diffusers_cross": (
        lambda: CrossAttention(context_dim=16),
        lambda: {"hidden_states": _x(2, 7, 32), "context": _x(2, 5, 16, seed=1)},
        "4 heads, cross-attention, q/k/v to_q/to_k/to_v, out to_out.0",
    ),
    "diffusers_self": (lambda: CrossAttention(), lambda: (_x(2, 7, 32),), "4 heads, q/k/v"),
    "imagen_masked": (
        lambda: ImagenAttention(),
        lambda: (_x(2, 7, 32), torch.arange(7) < torch.tensor([[7], [4]])),
        "4 heads, q/k/v to_q/to_kv, out to_out.0",
    ),
    "imagen_causal": (lambda: ImagenAttention(causal=True), lambda: _x(2, 7, 32), "4 heads"),
    "gpt_causal": (lambda: GPTAttention(), lambda: _x(2, 9, 32), "4 heads, q/k/v c_qkv, out c_o"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_of_unknown_families_is_found_swapped_and_equal(case: str) -> None:
    make, sample, detail = CASES[case]
    torch.manual_seed(0)
    module = make()
    reference = copy.deepcopy(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # found, and no revert
        report = swap_attention(module, "sdpa", sample=sample())
    (entry,) = report.modules
    assert (entry.name, entry.family, entry.status) == ("", "traced", "active")
    assert entry.checked == "forward+backward"
    assert entry.parity_error is not None
    assert entry.parity_error < 1e-5
    assert entry.detail.startswith(detail)
    assert module.state_dict().keys() == reference.state_dict().keys()
    _assert_same_numbers(module, reference, sample())
    ops = count_flops(lambda: _call(module, sample())).by_operator
    assert any("scaled_dot_product" in op for op in ops)  # the fused kernel ran
    assert not any(op in ("aten.bmm", "aten._softmax") for op in ops)  # eager attention did not


def test_other_shapes_and_self_attention_calls_run_fused_and_equal() -> None:
    module = CrossAttention(context_dim=16)
    reference = copy.deepcopy(module)
    swap_attention(module, "sdpa", sample={"hidden_states": _x(2, 7, 32), "context": _x(2, 5, 16)})
    _assert_same_numbers(
        module, reference, {"hidden_states": _x(3, 11, 32), "context": _x(3, 2, 16)}
    )
    self_attention = CrossAttention()
    reference = copy.deepcopy(self_attention)
    swap_attention(self_attention, "math", sample=(_x(2, 7, 32),))
    _assert_same_numbers(self_attention, reference, (_x(1, 13, 32),))


def test_a_mask_made_from_buffers_becomes_is_causal_one_from_inputs_stays_a_mask() -> None:
    calls: list[dict[str, Any]] = []
    gpt, imagen = GPTAttention(), ImagenAttention()
    swap_attention(gpt, "sdpa", sample=_x(2, 9, 32))
    swap_attention(imagen, "sdpa", sample=(_x(2, 7, 32), torch.ones(2, 7, dtype=torch.bool)))
    for module in (gpt, imagen):
        attend = swapped_modules(module)[""].ctx.attend

        def spy(*args: Any, _attend: Any = attend, **kwargs: Any) -> Tensor:
            calls.append(kwargs)
            return type(_attend).__call__(_attend, *args, **kwargs)

        swapped_modules(module)[""].ctx = swapped_modules(module)[""].ctx.__class__(
            module,
            swapped_modules(module)[""].original,
            spy,
            swapped_modules(module)[""].ctx.binding,
        )
    gpt(_x(2, 9, 32))
    imagen(_x(2, 7, 32), torch.arange(7) < torch.tensor([[7], [3]]))
    assert calls[0]["is_causal"] is True
    assert calls[0]["attn_mask"] is None  # flash kernels can run
    assert calls[1]["is_causal"] is False
    assert calls[1]["attn_mask"] is not None  # the padding mask came with the call
    assert calls[1]["attn_mask"].shape == (2, 1, 1, 8)


def test_a_softmax_that_is_not_attention_keeps_its_forward() -> None:
    model = nn.Sequential(Block(ViTAttention()), Mixture())
    reference = copy.deepcopy(model)
    report = swap_attention(model, "sdpa", sample=_x(2, 7, 32))
    assert report.swapped == ["0.attention"]  # the block's attention, not the block, not the gate
    assert "forward" not in model[1].__dict__
    _assert_same_numbers(model, reference, _x(2, 5, 32))


def test_a_model_without_attention_warns_with_the_way_out() -> None:
    with pytest.warns(UserWarning, match="found no attention module in Mixture.*register_adapter"):
        report = swap_attention(Mixture(), "sdpa", sample=_x(2, 7, 32))
    assert report.modules == []


def test_weights_changed_after_the_softmax_are_not_attention_and_keep_their_forward() -> None:
    module = HeadAveragedAttention()
    x = _x(2, 6, 32)
    expected = module(x)
    with pytest.warns(UserWarning, match="found no attention module in HeadAveragedAttention"):
        report = swap_attention(module, "sdpa", sample=x)
    assert report.modules == []
    torch.testing.assert_close(module(x), expected)


def test_attention_that_returns_its_weights_is_refused_and_keeps_its_forward() -> None:
    class ReturnsWeights(ViTAttention):
        def forward(self, x: Tensor) -> Any:
            b, n, _ = x.shape
            q, k, v = (
                t.reshape(b, n, self.heads, -1).transpose(1, 2)
                for t in self.to_qkv(x).chunk(3, dim=-1)
            )
            attn = (q @ k.transpose(-1, -2) * self.scale).softmax(-1)
            return self.to_out((attn @ v).transpose(1, 2).reshape(b, n, -1)), attn

    module = ReturnsWeights()
    x = _x(2, 6, 32)
    expected = module(x)
    with pytest.warns(UserWarning, match="kept .* own attention .*attention weights are returned"):
        report = swap_attention(module, "sdpa", sample=x)
    ((name, _),) = report.reverted
    assert (name, report.modules[0].family) == ("", "traced")
    assert "forward" not in module.__dict__
    for out, ref in zip(module(x), expected, strict=True):
        torch.testing.assert_close(out, ref)


def test_without_a_sample_the_first_call_finds_and_checks() -> None:
    model = nn.Sequential(Block(CrossAttention()), Block(ViTAttention()))
    reference = copy.deepcopy(model)
    report = swap_attention(model, "sdpa")
    assert report.modules == []  # nothing is known before the model runs
    out = model(_x(2, 7, 32))  # traced, found, checked (forward and backward)
    torch.testing.assert_close(out, reference(_x(2, 7, 32)))
    assert report.swapped == ["0.attention", "1.attention"]
    assert all(m.checked == "forward+backward" for m in report.modules)
    assert all(m.parity_error is not None and m.parity_error < 1e-5 for m in report.modules)
    _assert_same_numbers(model, reference, _x(3, 4, 32))


def test_attention_dropout_runs_in_the_fused_kernel_in_training() -> None:
    module = GPTAttention(p=0.5)
    swap_attention(module, "sdpa", sample=_x(2, 9, 32))
    calls: list[float] = []
    swap = swapped_modules(module)[""]
    attend = swap.ctx.attend

    def spy(*args: Any, **kwargs: Any) -> Tensor:
        calls.append(kwargs["dropout_p"])
        return attend(*args, **kwargs)

    swap.ctx = type(swap.ctx)(module, swap.original, spy, swap.ctx.binding)  # type: ignore[arg-type]
    module.train()(_x(2, 9, 32))
    module.eval()(_x(2, 9, 32))
    assert calls == [0.5, 0.0]


def test_swapped_model_compiles_and_matches() -> None:
    model, reference = Block(ViTAttention()), None
    reference = copy.deepcopy(model)
    swap_attention(model, "sdpa", sample=_x(2, 7, 32))
    compiled = torch.compile(model, backend="aot_eager")
    torch.testing.assert_close(
        compiled(_x(2, 5, 32)), reference(_x(2, 5, 32)), rtol=1e-5, atol=1e-5
    )


def test_blocks_compiled_in_place_compile_once_after_the_traced_first_call() -> None:
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    model = nn.Sequential(Block(ViTAttention()), Block(ViTAttention()))
    reference = copy.deepcopy(model)
    report = swap_attention(model, "sdpa")
    for block in model:
        block.compile(backend=counter)
    model(_x(2, 7, 32))  # traced (compiled code runs eagerly meanwhile), found, checked
    assert counter.frame_count == 0
    assert report.swapped == ["0.attention", "1.attention"]
    torch.testing.assert_close(model(_x(2, 7, 32)), reference(_x(2, 7, 32)), rtol=1e-5, atol=1e-5)
    compiled = counter.frame_count
    assert compiled > 0
    model(_x(2, 7, 32))
    assert counter.frame_count == compiled  # nothing the discovery left changes a guard


def test_probes_left_in_compiled_blocks_do_not_make_them_compile_apart() -> None:
    """The structural family claims these blocks' attention; their MLPs stay probed (a probe
    inside compiled code does nothing) and must not make the blocks of one class differ."""
    from torch._dynamo.testing import CompileCounter

    from speedkit_examples.vlm.model import VisionBlock

    counts = []
    for swap in (False, True):
        torch._dynamo.reset()
        counter = CompileCounter()
        torch.manual_seed(0)
        model = nn.Sequential(*(VisionBlock(32, 4, 2) for _ in range(3)))
        if swap:
            swap_attention(model, "sdpa")
        for block in model:
            block.compile(backend=counter)
        for _ in range(3):
            model(_x(2, 7, 32))
        counts.append(counter.frame_count)
    assert counts[1] == counts[0]


def test_einops_rearrange_is_followed() -> None:
    einops = pytest.importorskip("einops")

    class Attention(ViTAttention):  # vit-pytorch as it is today: einops, matmul, a norm inside
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(32)

        def forward(self, x: Tensor) -> Tensor:
            x = self.norm(x)
            qkv = self.to_qkv(x).chunk(3, dim=-1)
            q, k, v = (einops.rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in qkv)
            dots = torch.matmul(q, k.transpose(-1, -2)) * self.scale
            out = torch.matmul(self.attend(dots), v)
            return self.to_out(einops.rearrange(out, "b h n d -> b n (h d)"))  # type: ignore[no-any-return]

    module = Attention()
    reference = copy.deepcopy(module)
    report = swap_attention(module, "sdpa", sample=_x(2, 7, 32))
    assert report.swapped == [""]
    _assert_same_numbers(module, reference, _x(2, 9, 32))


def test_a_module_called_twice_in_one_forward_is_swapped_once() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = ViTAttention()

        def forward(self, x: Tensor) -> Tensor:
            return self.attention(self.attention(x))  # type: ignore[no-any-return]

    model = Twice()
    reference = copy.deepcopy(model)
    report = swap_attention(model, "sdpa", sample=_x(2, 7, 32))
    assert report.swapped == ["attention"]
    _assert_same_numbers(model, reference, _x(2, 5, 32))
