"""count_flops on fused recurrent kernels, grouped and transposed convolutions' backward, and
the operators it cannot price: hand counts, and the same layers written out in priced parts."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import flop_counter

from lightning_speedkit import count_flops
from lightning_speedkit.measure import flops as flops_module
from lightning_speedkit.measure._flop_book import FlopSession
from lightning_speedkit.measure._flop_formulas import EXTRA_FORMULAS, looks_costly

# --- recurrent layers ----------------------------------------------------------------------


def _lstm_forward(
    tokens: int, d_in: int, hidden: int, layers: int, dirs: int, proj: int = 0
) -> int:
    """2 FLOPs per MAC: each token meets W_ih (4H x in), W_hh (4H x out) and W_hr (P x H) once
    per layer and direction; a layer after the first takes the directions' outputs."""
    out = proj or hidden
    macs = 0
    for layer in range(layers):
        d = d_in if layer == 0 else out * dirs
        macs += dirs * (4 * hidden * d + 4 * hidden * out + proj * hidden)
    return 2 * tokens * macs


@pytest.mark.parametrize(
    ("layers", "bidirectional", "bias"), [(1, False, True), (2, True, True), (1, False, False)]
)
def test_lstm_on_cpu_is_its_matmuls_forward_and_twice_that_backward(
    layers: int, bidirectional: bool, bias: bool
) -> None:
    B, S, D, H = 3, 7, 10, 12
    lstm = nn.LSTM(D, H, num_layers=layers, bidirectional=bidirectional, bias=bias,
                   batch_first=True)  # fmt: skip
    x = torch.randn(B, S, D, requires_grad=True)
    forward = _lstm_forward(B * S, D, H, layers, 1 + bidirectional)

    assert count_flops(lambda: lstm(x)).total == forward
    step = count_flops(lambda: lstm(x)[0].sum().backward())
    assert step.total == step.model == 3 * forward  # oneDNN's backward: data and weights
    assert step.by_operator == {
        "aten.mkldnn_rnn_layer_backward": 2 * forward,  # the kernel torch runs on CPU,
        "aten.mkldnn_rnn_layer": forward,  # once per layer and direction
    }
    assert step.unpriced == {}


def test_a_frozen_lstm_on_cpu_still_pays_its_weight_gradients() -> None:
    """oneDNN's backward computes every gradient whatever autograd needs: priced as it runs."""
    B, S, D, H = 2, 5, 8, 8
    lstm = nn.LSTM(D, H, batch_first=True).requires_grad_(False)
    x = torch.randn(B, S, D, requires_grad=True)
    step = count_flops(lambda: lstm(x)[0].sum().backward())
    assert step.by_operator["aten.mkldnn_rnn_layer_backward"] == 2 * _lstm_forward(
        B * S, D, H, 1, 1
    )


class _LoopLSTM(nn.Module):
    """One LSTM layer as an explicit loop of two Linear layers (torch prices their matmuls)."""

    def __init__(self, lstm: nn.LSTM) -> None:
        super().__init__()
        self.ih = nn.Linear(lstm.input_size, 4 * lstm.hidden_size)
        self.hh = nn.Linear(lstm.hidden_size, 4 * lstm.hidden_size)
        with torch.no_grad():
            for name in ("weight", "bias"):
                getattr(self.ih, name).copy_(lstm.get_parameter(f"{name}_ih_l0"))
                getattr(self.hh, name).copy_(lstm.get_parameter(f"{name}_hh_l0"))

    def forward(self, x: Tensor, h: Tensor, c: Tensor) -> Tensor:
        outs = []
        for t in range(x.shape[1]):
            i, f, g, o = (self.ih(x[:, t]) + self.hh(h)).chunk(4, dim=-1)
            c = f.sigmoid() * c + i.sigmoid() * g.tanh()
            h = o.sigmoid() * c.tanh()
            outs.append(h)
        return torch.stack(outs, dim=1)


def test_lstm_counts_as_the_same_lstm_written_as_a_loop_of_linear_layers() -> None:
    B, S, D, H = 2, 6, 8, 16
    lstm = nn.LSTM(D, H, batch_first=True)
    loop = _LoopLSTM(lstm)
    x = torch.randn(B, S, D, requires_grad=True)
    # Initial states that need gradients: oneDNN computes theirs always, and the loop then
    # computes the first step's too (else it skips one step's hidden-state product).
    h0, c0 = torch.randn(B, H, requires_grad=True), torch.randn(B, H, requires_grad=True)

    def fused() -> Tensor:
        return lstm(x, (h0[None], c0[None]))[0]

    torch.testing.assert_close(loop(x, h0, c0), fused(), rtol=1e-4, atol=1e-5)  # same LSTM
    fused_step = count_flops(lambda: fused().sum().backward())
    loop_step = count_flops(lambda: loop(x, h0, c0).sum().backward())
    assert fused_step.total == loop_step.total == 3 * _lstm_forward(B * S, D, H, 1, 1)
    assert "aten.mkldnn_rnn_layer" in fused_step.by_operator
    assert set(loop_step.by_operator) == {"aten.addmm", "aten.mm"}


def _meta(*shape: int) -> Tensor:
    return torch.empty(shape, device="meta")


def _cudnn_weights(d_in: int, hidden: int, proj: int, layers: int, dirs: int) -> list[Tensor]:
    """nn.LSTM's flat weights as cuDNN takes them: per layer and direction w_ih, w_hh, b_ih,
    b_hh, w_hr (weight_stride0 = 5)."""
    out, weights = proj or hidden, []
    for layer in range(layers):
        d = d_in if layer == 0 else out * dirs
        for _ in range(dirs):
            weights += [_meta(4 * hidden, d), _meta(4 * hidden, out), _meta(4 * hidden),
                        _meta(4 * hidden), _meta(proj, hidden)]  # fmt: skip
    return weights


def test_cudnn_lstm_with_projections_is_priced_from_its_schema() -> None:
    """The cuDNN kernel, run through its meta kernel here (the CUDA check is below)."""
    S, B, D, H, P, layers, dirs = 5, 3, 10, 12, 6, 2, 2
    weights = _cudnn_weights(D, H, P, layers, dirs)
    x = _meta(S, B, D)
    hx, cx = _meta(layers * dirs, B, P), _meta(layers * dirs, B, H)

    def run() -> None:
        torch.ops.aten._cudnn_rnn.default(
            x, weights, 5, None, hx, cx, 2, H, P, layers, False, 0.0, True, True, [], None
        )

    forward = _lstm_forward(S * B, D, H, layers, dirs, proj=P)
    assert count_flops(run).by_operator == {"aten._cudnn_rnn": forward}

    backward = EXTRA_FORMULAS["aten::_cudnn_rnn_backward"]
    grad = _meta(S, B, P * dirs)

    def priced(grads: tuple[Tensor | None, ...], mask: tuple[bool, ...]) -> int:
        return backward(x, weights, 5, _meta(1), hx, cx, grad, *grads, 2, H, P, layers,
                        False, 0.0, True, True, [], None, _meta(1), mask)  # fmt: skip

    assert priced((grad, None, None), (True, True, True, True)) == 2 * forward
    # Frozen weights: no weight pass; the data pass runs even for inputs that need none.
    assert priced((grad, None, None), (False, False, False, False)) == forward
    assert priced((None, None, None), (True, True, True, True)) == 0  # nothing flows back
    assert EXTRA_FORMULAS["aten::miopen_rnn_backward"] is backward  # MIOpen: same schema


@pytest.mark.gpu
@pytest.mark.parametrize("frozen", [False, True])
def test_lstm_on_cuda_is_priced_through_cudnn(frozen: bool) -> None:
    B, S, D, H, P = 4, 9, 16, 32, 8
    lstm = nn.LSTM(D, H, num_layers=2, bidirectional=True, proj_size=P, batch_first=True).cuda()
    lstm.requires_grad_(not frozen)
    x = torch.randn(B, S, D, device="cuda", requires_grad=True)
    forward = _lstm_forward(B * S, D, H, 2, 2, proj=P)
    step = count_flops(lambda: lstm(x)[0].sum().backward())
    assert step.by_operator == {
        "aten._cudnn_rnn_backward": forward if frozen else 2 * forward,
        "aten._cudnn_rnn": forward,
    }
    assert step.unpriced == {}


# --- convolutions --------------------------------------------------------------------------


_Conv = nn.Conv1d | nn.Conv2d | nn.Conv3d | nn.ConvTranspose2d
_CONVS: dict[str, Callable[[], tuple[_Conv, Tensor]]] = {
    "depthwise1d": lambda: (nn.Conv1d(12, 12, 7, padding=3, groups=12, bias=False),
                            torch.randn(3, 12, 20)),
    "grouped2d": lambda: (nn.Conv2d(8, 12, 3, padding=1, stride=2, groups=4),
                          torch.randn(2, 8, 9, 9)),
    "transposed2d": lambda: (nn.ConvTranspose2d(6, 8, 3, stride=2, groups=2),
                             torch.randn(2, 6, 5, 5)),
    "plain3d": lambda: (nn.Conv3d(3, 4, 3, padding=1), torch.randn(1, 3, 4, 5, 6)),
}  # fmt: skip


def _conv_forward(conv: _Conv, x: Tensor) -> int:
    """2 FLOPs per MAC: every weight tap meets each output position (a transposed conv's:
    each input position) of each sample. The weight holds in_channels // groups already."""
    out = conv(x)
    spatial = (x if isinstance(conv, nn.ConvTranspose2d) else out).shape[2:]
    return 2 * x.shape[0] * spatial.numel() * conv.weight.numel()


@pytest.mark.parametrize("name", list(_CONVS))
def test_conv_training_flops_are_three_forwards_whatever_the_groups(name: str) -> None:
    conv, x = _CONVS[name]()
    forward = _conv_forward(conv, x)
    x.requires_grad_()
    assert count_flops(lambda: conv(x)).total == forward
    step = count_flops(lambda: conv(x).sum().backward())
    assert step.by_operator == {"aten.convolution_backward": 2 * forward,
                                "aten.convolution": forward}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "input_grad", "weight_grad"),
    [("depthwise1d", False, True), ("grouped2d", True, False), ("transposed2d", False, True)],
)
def test_conv_backward_prices_only_the_gradients_asked_for(
    name: str, input_grad: bool, weight_grad: bool
) -> None:
    """The network's first layer computes no input gradient; a frozen one no weight
    gradient."""
    conv, x = _CONVS[name]()
    forward = _conv_forward(conv, x)
    conv.requires_grad_(weight_grad)
    x.requires_grad_(input_grad)
    step = count_flops(lambda: conv(x).sum().backward())
    assert step.by_operator["aten.convolution_backward"] == forward


def _as_separate_convs(conv: _Conv, x: Tensor) -> Tensor:
    """The grouped conv as ``groups`` convolutions of one group each, outputs concatenated."""
    groups = conv.groups
    parts = zip(x.chunk(groups, dim=1), conv.weight.chunk(groups, dim=0), strict=True)
    if isinstance(conv, nn.ConvTranspose2d):
        outs = [F.conv_transpose2d(xi, wi, stride=conv.stride) for xi, wi in parts]
    else:
        fn = {1: F.conv1d, 2: F.conv2d}[x.ndim - 2]
        outs = [fn(xi, wi, stride=conv.stride, padding=conv.padding) for xi, wi in parts]
    out = torch.cat(outs, dim=1)
    return out if conv.bias is None else out + conv.bias.view(1, -1, *[1] * (out.ndim - 2))


@pytest.mark.parametrize("name", ["depthwise1d", "grouped2d", "transposed2d"])
def test_grouped_conv_counts_as_its_groups_run_separately(name: str) -> None:
    conv, x = _CONVS[name]()
    x.requires_grad_()
    torch.testing.assert_close(_as_separate_convs(conv, x), conv(x))  # the same layer
    grouped = count_flops(lambda: conv(x).sum().backward())
    separate = count_flops(lambda: _as_separate_convs(conv, x).sum().backward())
    assert grouped.total == separate.total == 3 * _conv_forward(conv, x)


# --- operators it cannot price -------------------------------------------------------------


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flops_module, "_WARNED", set())  # said once per process: afresh here


@pytest.mark.usefixtures("fresh_warnings")
def test_an_unpriced_costly_operator_is_named_once() -> None:
    x = torch.randn(4, 64)
    with pytest.warns(UserWarning, match=r"no formula for aten\._fft_r2c \(1 call\), so counts"):
        result = count_flops(torch.fft.rfft, x)
    assert result.total == 0
    assert result.unpriced == {"aten._fft_r2c": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second count says nothing more
        again = count_flops(lambda: [torch.fft.rfft(x) for _ in range(3)])
    assert again.unpriced == {"aten._fft_r2c": 3}  # the result still tells


@pytest.mark.usefixtures("fresh_warnings")
def test_a_training_step_of_priced_and_elementwise_work_warns_nothing() -> None:
    emb, lstm, conv = nn.Embedding(50, 16), nn.LSTM(16, 16, batch_first=True), nn.Conv1d(
        16, 16, 5, padding=2, groups=16)  # fmt: skip
    norm, head = nn.LayerNorm(16), nn.Linear(16, 50)
    ids = torch.randint(0, 50, (2, 9))

    def step() -> None:
        h = lstm(emb(ids))[0]
        h = F.gelu(conv(h.transpose(1, 2))).transpose(1, 2)
        logits = head(F.dropout(norm(h), 0.1).softmax(-1))
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert count_flops(step).unpriced == {}


@pytest.mark.usefixtures("fresh_warnings")
def test_a_formula_registered_with_torch_prices_the_operator() -> None:
    """The warning's advice works: torch's registry is read."""
    packet = torch.ops.aten._fft_r2c

    @flop_counter.register_flop_formula(packet)
    def _r2c(x_shape: torch.Size, *args: object, **kwargs: object) -> int:
        return 7 * x_shape.numel()

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            result = count_flops(torch.fft.rfft, torch.randn(4, 64))
    finally:
        del flop_counter.flop_registry[packet]
    assert (result.total, result.unpriced) == (7 * 4 * 64, {})


@pytest.mark.usefixtures("fresh_warnings")
def test_speed_monitor_counts_warn_too() -> None:
    session = FlopSession()  # what SpeedMonitor opens for a counted step
    torch.fft.rfft(torch.randn(2, 8))
    with pytest.warns(UserWarning, match=r"aten\._fft_r2c \(1 call\)"):
        assert session.close() == (0.0, 0.0)


@pytest.mark.parametrize(
    "name",
    ["aten::_fft_r2c", "aten._grouped_mm", "aten::mv", "aten::slow_conv3d_forward",
     "aten::_native_multi_head_attention", "aten::miopen_rnn", "mylib::fused_conv2d"],
)  # fmt: skip
def test_costly_operators_are_told_by_name(name: str) -> None:
    assert looks_costly(name)


@pytest.mark.parametrize(
    "name",
    ["aten::add", "aten::mvlgamma", "aten::_convert_weight_to_int4pack", "aten::fft_fftfreq",
     "aten::upsample_linear1d", "aten::_thnn_fused_lstm_cell", "aten::native_layer_norm",
     "aten::embedding_dense_backward", "aten::_softmax", "mkldnn::_reorder_convolution_weight"],
)  # fmt: skip
def test_cheap_operators_are_not(name: str) -> None:
    assert not looks_costly(name)
