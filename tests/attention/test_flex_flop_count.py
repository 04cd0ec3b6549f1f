"""FlexAttention under the kit's FLOP count: it runs, and it is priced.

torch refuses FlexAttention under any dispatch mode but its own, and the count is one
(``count_flops``, and SpeedMonitor's count of the first training step). The kit's flex
calls therefore run with the count set aside and are priced by formula: dense attention
over each document, what the per-document SDPA path is counted at.

FlexAttention has a forward on CPU (its reference implementation) and no backward, so
the forward runs here on frozen attention; the backward's price is checked through a
stand-in kernel that refuses dispatch modes as FlexAttention does.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap, SpeedMonitor, _compat
from lightning_speedkit.attention import backends, packed_documents
from lightning_speedkit.attention.backends import Attend
from lightning_speedkit.data import PackingCollate
from lightning_speedkit.measure.flops import KernelFlops, count_flops, run_unseen

from .test_packed_documents import NanoGPT, _samples
from .test_packed_flex import _quiet_eager_flex  # noqa: F401 (autouse)

LENGTHS = (5, 3, 7, 2, 4, 6)  # rows of 12: [5, 3, pad 4], [7, 2, pad 3], [4, 6, pad 2]


def _qkv() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 4, 12, 16, generator=g), *(
        torch.randn(3, 2, 12, 16, generator=g) for _ in range(2)
    )


def _packed() -> dict[str, Any]:
    return PackingCollate(max_tokens=12)([{"input_ids": torch.zeros(n, dtype=torch.long)}
                                          for n in LENGTHS])  # fmt: skip


def _count(backend: str, packed: bool) -> tuple[int, Tensor]:
    q, k, v = _qkv()
    out: list[Tensor] = []
    with torch.no_grad():
        if packed:
            with packed_documents(_packed()):
                count = count_flops(lambda: out.append(Attend(backend)(q, k, v, is_causal=True)))
        else:
            count = count_flops(lambda: out.append(Attend(backend)(q, k, v, is_causal=True)))
    assert count.total == count.model
    return count.total, out[0]


@pytest.mark.parametrize("packed", [False, True], ids=["whole rows", "packed"])
def test_flex_runs_under_a_flop_count_at_the_sdpa_price(packed: bool) -> None:
    # Before: TypeError, no implementation of flex_attention in the count's dispatch mode.
    flex_flops, flex_out = _count("flex", packed)
    sdpa_flops, sdpa_out = _count("sdpa", packed)
    assert (flex_out - sdpa_out).abs().max().item() <= 1e-5
    assert flex_flops == sdpa_flops  # packed: per document, padding spans included
    # by hand: 2 matmuls of 2*S_q*S_k*D per head, over 4 heads
    lengths = [5, 3, 4, 7, 2, 3, 4, 6, 2] if packed else [12, 12, 12]
    assert flex_flops == sum(2 * 2 * 4 * n * n * 16 for n in lengths)


class _Refusing(torch.autograd.Function):
    """A kernel that, like FlexAttention, raises under a dispatch mode it does not know."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        if _compat.dispatch_mode_active():
            raise TypeError("no implementation found in mode")
        ctx.save_for_backward(x)
        return x.tanh()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return grad * (1 - x.tanh() ** 2)


PRICE = KernelFlops("refusing", forward=100, backward=300, rescored=40)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)  # counted as it runs
        return run_unseen(lambda: _Refusing.apply(h), lambda: PRICE)


def test_an_unseen_kernel_counts_forward_and_backward_by_its_price() -> None:
    block = _Block()
    x = torch.randn(4, 8)
    count = count_flops(lambda: block(x).sum().backward())
    matmuls = 2 * 4 * 8 * 8 * 2  # the projection forward, and its weight gradient
    assert count.by_operator == {"aten.mm": matmuls, "refusing": 100, "refusing_backward": 300}
    assert count.total == matmuls + 400
    assert count.model == count.total - 40  # the rescored scores are hardware FLOPs only
    assert count.by_module == {"proj": matmuls, "(own operators)": 100 + 300 - 40}
    expected = torch.autograd.grad(_Refusing.apply(block.proj(x)).sum(), block.proj.weight)[0]
    block.zero_grad()
    count_flops(lambda: block(x).sum().backward())
    assert torch.equal(block.proj.weight.grad, expected)


def test_an_unseen_kernel_recomputed_by_a_checkpoint_counts_as_recomputation() -> None:
    block = _Block()
    x = torch.randn(4, 8, requires_grad=True)
    plain = count_flops(lambda: block(x).sum().backward())
    checkpointed = count_flops(
        lambda: checkpoint(block, x, use_reentrant=False).sum().backward()  # type: ignore[union-attr]
    )
    recompute = 2 * 4 * 8 * 8 + 100  # the projection and the kernel's forward, again
    assert checkpointed.total == plain.total + recompute
    assert checkpointed.model == plain.model


def test_outside_a_count_the_call_is_left_as_it_is() -> None:
    x = torch.randn(3, requires_grad=True)
    out = run_unseen(lambda: x * 2, lambda: PRICE)
    assert out.grad_fn is not None
    assert out.grad_fn.name() == "MulBackward0"


class _FlexOnCPU(torch.autograd.Function):
    """FlexAttention as it is on a GPU, for a fit on CPU: refused under a dispatch mode,
    and a backward the count cannot see (compiled FlexAttention's are Triton kernels)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: Any) -> Tensor:
        if _compat.dispatch_mode_active():
            raise TypeError("no implementation found for 'torch.ops.higher_order.flex_attention'")
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale = scale
        return _dense(q, k, v, mask, scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        *qkv, mask = ctx.saved_tensors
        q, k, v = (t.detach().requires_grad_() for t in qkv)
        with _compat.dispatch_modes_set_aside(), torch.enable_grad():
            grads = torch.autograd.grad(_dense(q, k, v, mask, ctx.scale), (q, k, v), grad)
        return *grads, None, None


def _dense(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: Any) -> Tensor:
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def _flex_on_cpu(device: torch.device) -> Any:
    from torch.nn.attention.flex_attention import create_mask

    def flex(q: Tensor, k: Tensor, v: Tensor, *, block_mask: Any, scale: Any, **_: Any) -> Tensor:
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[-2], k.shape[-2], "cpu")
        return _FlexOnCPU.apply(q, k, v, mask, scale)

    return flex


class _Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = NanoGPT()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        logits = self.model(batch["input_ids"], batch["position_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(backend: str) -> tuple[AttentionSwap, SpeedMonitor]:
    swap = AttentionSwap(backend=backend, verbose=False)
    monitor = SpeedMonitor(log_every_n_steps=1)
    trainer = L.Trainer(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[swap, monitor],
    )  # fmt: skip
    samples = _samples()
    loader = DataLoader(samples, batch_size=len(samples), collate_fn=PackingCollate(max_tokens=12))
    trainer.fit(_Task(), loader)
    return swap, monitor


def test_flex_beside_speed_monitor_stays_swapped_and_is_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: the module's check in SpeedMonitor's counted step raised, and it was reverted.
    sdpa_swap, sdpa_monitor = _fit("sdpa")
    cannot_run = Attend._cannot_run
    monkeypatch.setattr(backends, "_flex_function", _flex_on_cpu)
    monkeypatch.setattr(Attend, "_cannot_run", lambda self, q, mask, grad: (
        None if self.backend == "flex" else cannot_run(self, q, mask, grad)))  # fmt: skip
    flex_swap, flex_monitor = _fit("flex")
    assert flex_swap.report is not None
    assert sdpa_swap.report is not None
    assert [m.backend.split()[0] for m in flex_swap.report.modules] == ["flex", "flex"]
    assert not flex_swap.report.reverted
    [flex_counted] = flex_monitor.flops.counted.values()
    [sdpa_counted] = sdpa_monitor.flops.counted.values()
    # attention priced per document, forward and backward, as the SDPA pieces are counted
    assert flex_counted.model == sdpa_counted.model > 0
    assert flex_counted.hardware == sdpa_counted.hardware


@pytest.mark.gpu
def test_compiled_flex_is_counted_once_forward_and_backward_on_cuda() -> None:
    """Compiled FlexAttention's backward runs under the count (its Triton kernels unseen):
    priced once by formula, and its gradients as without the count."""
    from lightning_speedkit.measure._flop_formulas import attention_flops

    q, k, v = (t.cuda().requires_grad_() for t in _qkv())
    batch = {key: value.cuda() if isinstance(value, Tensor) else value
             for key, value in _packed().items()}  # fmt: skip

    def step() -> None:
        with packed_documents(batch):
            Attend("flex")(q, k, v, is_causal=True).square().sum().backward()

    step()
    plain = [t.grad.clone() for t in (q, k, v)]  # type: ignore[union-attr]
    for t in (q, k, v):
        t.grad = None
    count = count_flops(step)
    assert all(torch.equal(t.grad, g) for t, g in zip((q, k, v), plain, strict=True))
    lengths = [5, 3, 4, 7, 2, 3, 4, 6, 2]
    price = attention_flops("flex_attention", 4, 16, 16, [(1, n, n) for n in lengths])
    assert count.by_operator == {"flex_attention": price.forward,
                                 "flex_attention_backward": price.backward}  # fmt: skip
    assert count.model == price.forward + price.backward - price.rescored


class _BackwardOperator(HigherOrderOperator):
    """A higher-order operator run in a backward, as eager FlexAttention's backward is (a
    swap's parity check runs the kernel eagerly, under torch.compile's ``force_eager``)."""

    def __init__(self) -> None:
        super().__init__("stand_in_attention_backward")
        self.fallthrough(DispatchKey.AutogradCPU)  # it runs inside a backward already

    def __call__(self, x: Tensor, grad: Tensor) -> Tensor:
        return super().__call__(x, grad)


_BACKWARD = _BackwardOperator()


@_BACKWARD.py_impl(DispatchKey.CompositeExplicitAutograd)
def _backward_kernel(x: Tensor, grad: Tensor) -> Tensor:
    return grad * (1 - x.tanh() ** 2)


class _EagerKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.tanh()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return _BACKWARD(x, grad)


def test_a_higher_order_backward_runs_under_the_count_priced_once() -> None:
    # Before: NotImplementedError ("no rule registered for HigherOrderOperator ... and
    # mode _Counter"), which reverted every module AttentionSwap put on FlexAttention when
    # its check ran inside SpeedMonitor's FLOP count (an H200, 2026-11-29).
    price = KernelFlops("stand_in_attention", forward=100, backward=300, rescored=40)
    x = torch.randn(4, 8, requires_grad=True)
    count = count_flops(lambda: run_unseen(lambda: _EagerKernel.apply(x), lambda: price)
                        .sum().backward())  # fmt: skip
    assert count.by_operator == {"stand_in_attention": 100, "stand_in_attention_backward": 300}
    assert count.unpriced == {}
    assert torch.allclose(x.grad, 1 - x.detach().tanh() ** 2)


def test_a_higher_order_operator_in_torchs_table_is_priced_by_it() -> None:
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    register_flop_formula(_BACKWARD, get_raw=True)(lambda x, grad, out_val=None: 7 * x.numel())
    try:
        x = torch.randn(4, 8, requires_grad=True)
        count = count_flops(lambda: _EagerKernel.apply(x).sum().backward())  # not prepaid
    finally:
        del flop_registry[_BACKWARD]
    assert count.by_operator == {"stand_in_attention_backward": 7 * 32}
