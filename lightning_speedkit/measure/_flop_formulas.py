"""FLOP formulas for operators torch's ``flop_counter`` does not price or prices wrong,
and the recomputation inside fused attention backward kernels.

torch prices matrix products and its own attention kernels; this adds its CPU
flash-attention kernel (which torch counts as 0), flash-attn's kernels (fixed and
variable length), xformers' cutlass kernels, each in the layout its kernel takes, and
the fused recurrent kernels (oneDNN's on CPU, cuDNN's and MIOpen's on GPUs) that
``nn.LSTM`` runs as. It corrects torch's ``convolution_backward``, which prices a
grouped convolution's weight gradient ``groups`` times too high. :func:`formula_for`
looks an operator up in the corrections, then in torch's registry, then here;
:func:`looks_costly` tells an unpriced operator worth a warning from element-wise work.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import flop_counter as _torch_flops

from lightning_speedkit import _compat

if TYPE_CHECKING:
    from lightning_speedkit._compat import OpOverload

_Formula = Callable[..., int]


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape)


# --- formulas torch lacks ---------------------------------------------------------------


def _cpu_flash_forward(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    # (B, H, S, D) layout, as the CUDA flash kernel torch already prices.
    return int(_torch_flops.sdpa_flop_count(_shape(query), _shape(key), _shape(value)))


def _cpu_flash_backward(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kw: Any
) -> int:
    return int(
        _torch_flops.sdpa_backward_flop_count(
            _shape(grad_out), _shape(query), _shape(key), _shape(value)
        )
    )


def _bshd_to_bhsd(shape: tuple[int, ...]) -> tuple[int, ...]:
    b, s, h, d = shape
    return (b, h, s, d)


def _flash_attn_forward(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    # flash-attn keeps (batch, seq, heads, head_dim).
    return int(
        _torch_flops.sdpa_flop_count(
            _bshd_to_bhsd(_shape(q)), _bshd_to_bhsd(_shape(k)), _bshd_to_bhsd(_shape(v))
        )
    )


def _flash_attn_backward(dout: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> int:
    return int(
        _torch_flops.sdpa_backward_flop_count(
            _bshd_to_bhsd(_shape(dout)),
            _bshd_to_bhsd(_shape(q)),
            _bshd_to_bhsd(_shape(k)),
            _bshd_to_bhsd(_shape(v)),
        )
    )


def _varlen_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    # SYNC: reads sequence offsets back to the host; only ever runs inside a counted step.
    offsets = cu_seqlens.tolist()
    return [b - a for a, b in itertools.pairwise(offsets)]


def _pairs(cu_q: torch.Tensor, cu_k: torch.Tensor) -> int:
    """Query-key pairs of a variable-length batch: the sum over documents of s_q * s_k."""
    return sum(a * b for a, b in zip(_varlen_lengths(cu_q), _varlen_lengths(cu_k), strict=True))


def _varlen_flops(q: Any, v: Any, cu_q: torch.Tensor, cu_k: torch.Tensor, passes: int) -> int:
    # (total_tokens, heads, head_dim); each document attends within itself.
    _, heads, d_qk = _shape(q)
    d_v = _shape(v)[-1]
    return passes * heads * _pairs(cu_q, cu_k) * (d_qk + d_v)


def _flash_attn_varlen_forward(
    q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, *a: Any, **kw: Any
) -> int:
    return _varlen_flops(q, v, cu_q, cu_k, passes=2)  # QK^T and PV: 2 FLOPs per MAC each


def _flash_attn_varlen_backward(
    dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dq: Any, dk: Any, dv: Any,
    cu_q: Any, cu_k: Any, *a: Any, **kw: Any,
) -> int:  # fmt: skip
    return _varlen_flops(q, v, cu_q, cu_k, passes=4)  # dV, dP, dQ, dK: as torch prices SDPA


def _offsets(rest: tuple[Any, ...]) -> tuple[Any, Any] | None:
    """The first two 1-D integer tensors: sequence offsets of a variable-length call.

    xformers' schemas moved these arguments between releases; their type does not move.
    """
    found = [
        a for a in rest
        if isinstance(a, torch.Tensor) and a.ndim == 1 and not a.is_floating_point()
    ]  # fmt: skip
    return (found[0], found[1]) if len(found) >= 2 else None


def _xformers_forward(q: Any, k: Any, v: Any, *rest: Any, **kwargs: Any) -> int:
    # (batch, seq, heads, head_dim), like flash-attn; variable length when offsets are given.
    offsets = _offsets(rest)
    if offsets is None:
        return _flash_attn_forward(q, k, v)
    _, _, heads, d = _shape(q)
    pairs = _pairs(*offsets)
    return 2 * heads * pairs * (d + _shape(v)[-1])


def _xformers_backward(grad: Any, q: Any, k: Any, v: Any, *rest: Any, **kwargs: Any) -> int:
    offsets = _offsets(rest)
    if offsets is None:
        return _flash_attn_backward(grad, q, k, v)
    _, _, heads, d = _shape(q)
    pairs = _pairs(*offsets)
    return 2 * heads * pairs * (3 * d + 2 * _shape(v)[-1])  # QK^T again, dP, dV, dQ, dK


def _xformers_rescore(grad: Any, q: Any, k: Any, *rest: Any, **kwargs: Any) -> int:
    offsets = _offsets(rest[1:])  # after v
    if offsets is None:
        return _scores_bshd(grad, q, k)
    _, _, heads, d = _shape(q)
    pairs = _pairs(*offsets)
    return 2 * heads * pairs * d


# --- recurrent layers: fused kernels --------------------------------------------------
#
# A fused RNN kernel multiplies every token by each weight matrix of each layer and
# direction once (W_ih, W_hh, and W_hr with ``proj_size``): 2 FLOPs a MAC, so
# 2 x gates x hidden x (input + hidden) per token per layer per direction for an LSTM
# (4 gates), the GRU's 3, a plain RNN's 1. Its backward is one pass for the data
# gradients (input, states: the recurrence needs them whatever autograd asks) and one for
# the weights: each the forward's products again, as torch prices a matmul's backward.
# Biases and gate non-linearities are element-wise: free.


def _rnn_flops(input: Any, weights: Iterable[Any]) -> int:
    tokens = input.numel() // _shape(input)[-1]  # (seq, batch, in), (batch, seq, in), packed
    return 2 * tokens * sum(w.numel() for w in weights if w.ndim == 2)  # 1-D ones: biases


def _mkldnn_rnn_layer(input: Any, w_ih: Any, w_hh: Any, *args: Any, **kwargs: Any) -> int:
    # One layer, one direction. oneDNN has no projections: torch runs an LSTM with
    # ``proj_size`` as matmuls. Without biases the bias slots repeat the weights: not read.
    return _rnn_flops(input, (w_ih, w_hh))


def _mkldnn_rnn_layer_backward(input: Any, w_ih: Any, w_hh: Any, *args: Any, **kwargs: Any) -> int:
    # oneDNN computes every gradient, frozen weights' and the first layer's input's too.
    return 2 * _rnn_flops(input, (w_ih, w_hh))


def _fused_rnn(input: Any, weight: list[Any], *args: Any, **kwargs: Any) -> int:
    # cuDNN and MIOpen: every layer and direction in one call; ``weight`` holds each
    # one's [w_ih, w_hh, (b_ih, b_hh), (w_hr)] in turn. Every layer sees every token.
    return _rnn_flops(input, weight)


def _fused_rnn_backward(
    input: Any, weight: list[Any], stride0: Any, buf: Any, hx: Any, cx: Any, output: Any,
    grad_output: Any, grad_hy: Any, grad_cy: Any, *rest: Any, **kwargs: Any,
) -> int:  # fmt: skip
    if grad_output is None and grad_hy is None and grad_cy is None:
        return 0  # torch returns at once: nothing to propagate
    # The data gradients always run ("it mutates reserve", aten/src/ATen/native/cudnn/RNN.cpp);
    # the weights' only when ``output_mask[3]`` (the schema's last argument) asks.
    output_mask = kwargs.get("output_mask", rest[-1] if rest else (True,) * 4)
    return (1 + bool(output_mask[3])) * _rnn_flops(input, weight)


# --- convolutions: torch's backward formula, with groups ----------------------------------


def _convolution_backward(
    grad_out: Any, input: Any, weight: Any, bias_sizes: Any, stride: Any, padding: Any,
    dilation: Any, transposed: bool, output_padding: Any, groups: int, output_mask: Any,
    **kwargs: Any,
) -> int:  # fmt: skip
    """Each gradient asked for (``output_mask``: input, weight, bias) costs what the
    forward does: every weight tap meets each position of the smaller map (the output's,
    or a transposed convolution's input's), per sample. The weight's shape already holds
    the groups (``in_channels // groups``). torch prices the weight gradient as a
    convolution of ``groups=1``, ``groups`` times too high (a depthwise layer of 32
    channels: 11x its training FLOPs). The bias gradient is a sum: free."""
    positions = math.prod(_shape(input if transposed else grad_out)[2:])
    forward = 2 * _shape(input)[0] * positions * weight.numel()
    return forward * (bool(output_mask[0]) + bool(output_mask[1]))


#: Formulas by operator name, used instead of torch's for operators it prices wrong.
CORRECTED_FORMULAS: dict[str, _Formula] = {
    "aten::convolution_backward": _convolution_backward,
}


#: Formulas by operator name, for operators torch does not price.
EXTRA_FORMULAS: dict[str, _Formula] = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": _cpu_flash_forward,
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": _cpu_flash_backward,
    "flash_attn::_flash_attn_forward": _flash_attn_forward,
    "flash_attn::_flash_attn_backward": _flash_attn_backward,
    "flash_attn::_flash_attn_varlen_forward": _flash_attn_varlen_forward,
    "flash_attn::_flash_attn_varlen_backward": _flash_attn_varlen_backward,
    "xformers::efficient_attention_forward_cutlass": _xformers_forward,
    "xformers::efficient_attention_backward_cutlass": _xformers_backward,
    "aten::mkldnn_rnn_layer": _mkldnn_rnn_layer,
    "aten::mkldnn_rnn_layer_backward": _mkldnn_rnn_layer_backward,
    "aten::_cudnn_rnn": _fused_rnn,
    "aten::_cudnn_rnn_backward": _fused_rnn_backward,
    "aten::miopen_rnn": _fused_rnn,
    "aten::miopen_rnn_backward": _fused_rnn_backward,
}


# Fused attention backward kernels recompute the scores QK^T (flash-style), and torch's
# formula includes that matmul. It is recomputation, so it counts for HFU, not for MFU:
# the model's backward is 2x its forward (PaLM's 12·L·H·Q·T), whatever the kernel.
def _scores_bhsd(grad: Any, q: Any, k: Any, *args: Any, **kwargs: Any) -> int:
    b, h, s_q, d = _shape(q)
    return 2 * b * h * s_q * _shape(k)[2] * d


def _scores_bshd(grad: Any, q: Any, k: Any, *args: Any, **kwargs: Any) -> int:
    b, s_q, h, d = _shape(q)
    return 2 * b * h * s_q * _shape(k)[1] * d


def _scores_varlen(
    dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dq: Any, dk: Any, dv: Any,
    cu_q: Any, cu_k: Any, *a: Any, **kw: Any,
) -> int:  # fmt: skip
    _, heads, d = _shape(q)
    return 2 * heads * _pairs(cu_q, cu_k) * d


#: Recomputed FLOPs inside a fused attention backward, by operator name.
RECOMPUTED_IN_BACKWARD: dict[str, _Formula] = {
    "aten::_scaled_dot_product_flash_attention_backward": _scores_bhsd,
    "aten::_scaled_dot_product_efficient_attention_backward": _scores_bhsd,
    "aten::_scaled_dot_product_cudnn_attention_backward": _scores_bhsd,
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": _scores_bhsd,
    "aten::_flash_attention_backward": _scores_bshd,
    "aten::_efficient_attention_backward": _scores_bshd,
    "flash_attn::_flash_attn_backward": _scores_bshd,
    "flash_attn::_flash_attn_varlen_backward": _scores_varlen,
    "xformers::efficient_attention_backward_cutlass": _xformers_rescore,
}


# --- kernels the count cannot see -------------------------------------------------------


@dataclass(frozen=True)
class KernelFlops:
    """What one call of a kernel the count cannot see costs, priced by formula
    (see :func:`~lightning_speedkit.measure.flops.run_unseen`).

    Attributes:
        operator: the name ``by_operator`` gives it (its backward adds ``"_backward"``).
        forward: the call's FLOPs.
        backward: its gradient's FLOPs, when autograd runs it.
        rescored: the part of ``backward`` that recomputes the attention scores.
    """

    operator: str
    forward: int
    backward: int
    rescored: int


def attention_flops(
    operator: str, heads: int, d_qk: int, d_v: int, pieces: Iterable[tuple[int, int, int]]
) -> KernelFlops:
    """Dense attention over ``pieces`` of ``(batch, query length, key length)``, priced
    as torch prices SDPA: a packed batch's documents are pieces of batch 1, so the
    price is what attending within documents costs, not over whole rows."""
    forward = backward = rescored = 0
    for batch, s_q, s_k in pieces:
        q, k, v = (batch, heads, s_q, d_qk), (batch, heads, s_k, d_qk), (batch, heads, s_k, d_v)
        forward += int(_torch_flops.sdpa_flop_count(q, k, v))
        backward += int(_torch_flops.sdpa_backward_flop_count((batch, heads, s_q, d_v), q, k, v))
        rescored += 2 * batch * heads * s_q * s_k * d_qk
    return KernelFlops(operator, forward, backward, rescored)


def formula_for(func: OpOverload) -> _Formula | None:
    """This module's correction of torch's formula for ``func``, else torch's formula, else
    this module's; None for an unpriced operator."""
    packet = func.overloadpacket
    name = _compat.qualified_op_name(packet)
    formula = CORRECTED_FORMULAS.get(name) or _torch_flops.flop_registry.get(packet)
    if formula is not None:
        return formula
    return EXTRA_FORMULAS.get(name)


# --- unpriced operators worth a word ------------------------------------------------------

#: Operator names (after ``namespace::``) of the kinds that carry a model's FLOPs: matrix
#: products, convolutions, recurrent layers, attention, FFTs. A stem counts as a word of
#: the name (``_fft_r2c``, ``slow_conv3d``, ``_grouped_mm``), not inside another word.
_COSTLY = re.compile(
    r"(?:^|_)(?:mm|bmm|addmm|addbmm|baddbmm|addmv|mv|dot|vdot|matmul|linear|gemm|cdist"
    r"|conv|convolution|rnn|lstm|gru|attention|attn|fft)(?=$|_|\d)"
)
#: ...less the bookkeeping and element-wise operators those names also start: weight
#: packing, plan caches, FFT frequencies, interpolation, and the fused LSTM/GRU cells'
#: gate arithmetic (their matmuls run, and are priced, before them).
_CHEAP = re.compile(
    r"prepack|unpack|pack_gemm|quantize_weight|reorder|flatten_weight|plan_cache|^_use_"
    r"|upsample|fftfreq|fftshift|^_thnn_(?:fused|differentiable)_"
)


@functools.cache
def looks_costly(name: str) -> bool:
    """Whether an operator named ``name`` (``"aten._fft_r2c"`` or ``"aten::_fft_r2c"``) is
    of a kind that carries a model's FLOPs, so that counting it as 0 leaves the count low."""
    bare = name.replace("::", ".").rpartition(".")[2]
    return bool(_COSTLY.search(bare)) and not _CHEAP.search(bare)
