"""Counting the FLOPs of a function: total, per module, model versus hardware.

``count_flops(fn, *args)`` runs ``fn`` once under a dispatch mode that prices
every ATen operator with torch's own formulas (``torch.utils.flop_counter``),
plus formulas torch lacks: its CPU flash-attention kernel (which torch counts as
0), flash-attn's kernels and the fused recurrent kernels ``nn.LSTM`` runs as, and
with torch's convolution backward corrected for groups. Only matrix products,
convolutions, recurrent layers and attention are priced, as in torch and in the MFU
literature; element-wise work is free. An operator that ran unpriced although it
looks costly (a matrix product, convolution, FFT, recurrent or attention kernel with
no formula) is named in ``FlopCount.unpriced`` and in a warning, once per operator.

Two totals come back:

- **hardware FLOPs** (``total``): everything that ran, activation recomputation
  included. Divided by time and peak, this is HFU.
- **model FLOPs** (``model``): the same minus recomputation, that is what the
  model needs whatever the memory strategy. Divided by time and peak, this is
  MFU (PaLM, appendix B). A recomputation is a forward operator that runs while
  autograd is executing the backward pass with gradients enabled: exactly what
  ``torch.utils.checkpoint`` (reentrant or not) does, and what ordinary backward
  never does.

Fused attention backward kernels recompute the attention scores; torch's formula
counts that matmul, so it goes to hardware FLOPs only, and model FLOPs keep the
backward at twice the forward, as PaLM's 12·L·H·Q·T does.

Frozen parameters cost no weight-gradient FLOPs because autograd never computes
those gradients: the counter prices what runs, not a formula.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils import flop_counter as _torch_flops

from lightning_speedkit import _compat, _validation
from lightning_speedkit._compat import TorchDispatchMode
from lightning_speedkit.measure._flop_formulas import EXTRA_FORMULAS as EXTRA_FORMULAS
from lightning_speedkit.measure._flop_formulas import (
    RECOMPUTED_IN_BACKWARD,
    KernelFlops,
    formula_for,
    looks_costly,
)
from lightning_speedkit.measure._flop_owners import Owners, top_level

if TYPE_CHECKING:
    from lightning_speedkit._compat import OpOverload

__all__ = ["FlopCount", "KernelFlops", "count_flops", "run_unseen"]


# --- the count ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one call. All figures are floating-point operations (a MAC is 2).

    Attributes:
        total: hardware FLOPs: everything that ran, recomputation included (for HFU).
        model: model FLOPs: ``total`` less activation recomputation (for MFU).
        by_module: model FLOPs per top-level module. Single-child wrappers (a
            LightningModule holding ``self.model``, DDP) are looked through, so a
            VLM gives e.g. ``{"vision": ..., "projector": ..., "language_model": ...}``.
        by_operator: hardware FLOPs per ATen operator.
        by_path: model FLOPs per module path at every depth (``"VLM.vision.blocks.0"``).
        unpriced: operators that ran and count 0 FLOPs, for want of a formula, though
            they look costly (matrix products, convolutions, FFTs, recurrent or attention
            kernels), with how many calls: the count leaves their work out.
    """

    total: int
    model: int
    by_module: dict[str, int] = field(default_factory=dict)
    by_operator: dict[str, int] = field(default_factory=dict)
    by_path: dict[str, int] = field(default_factory=dict)
    unpriced: dict[str, int] = field(default_factory=dict)

    @property
    def recomputed(self) -> int:
        """FLOPs spent recomputing activations (``total - model``)."""
        return self.total - self.model


_PAUSED = 0


@contextlib.contextmanager
def not_counted() -> Iterator[None]:
    """Leave the work inside out of any running :func:`count_flops`.

    For the kit's own one-off work inside a training step (AttentionSwap's
    parity check), which is not the model's.
    """
    global _PAUSED
    _PAUSED += 1
    try:
        yield
    finally:
        _PAUSED -= 1


_ACTIVE: list[_Counter] = []


def model_flops_so_far() -> int | None:
    """The running FLOP count's model FLOPs so far (None when nothing is counting): what a
    call costs is the difference across it."""
    if not _ACTIVE:
        return None
    counter = _ACTIVE[-1]
    return counter.total - counter.recomputed


class _Counter(TorchDispatchMode):
    #: Higher-order operators reach :meth:`__torch_dispatch__` too (see :meth:`_higher_order`).
    supports_higher_order_operators = True

    def __enter__(self) -> _Counter:
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _ACTIVE.remove(self)
        _warn_unpriced(self.unpriced)

    def __init__(self, tracker: Owners) -> None:
        super().__init__()
        self.tracker = tracker
        self.total = 0
        self.recomputed = 0
        self.by_operator: dict[str, int] = defaultdict(int)
        self.by_path: dict[str, int] = defaultdict(int)
        self.unpriced: Counter[str] = Counter()
        #: Backward kernels :func:`run_unseen` priced already, by name, not yet run.
        self.prepaid: Counter[str] = Counter()

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not hasattr(func, "overloadpacket"):  # a higher-order operator, not an ATen one
            return self._higher_order(func, args, kwargs)
        out = func(*args, **kwargs)
        formula = formula_for(func)
        if formula is None or _PAUSED:
            if formula is None and not _PAUSED and looks_costly(str(func.overloadpacket)):
                self.unpriced[str(func.overloadpacket)] += 1  # as by_operator names it
            return out
        flops = int(formula(*args, **kwargs, out_val=out))
        if flops:
            rescore = RECOMPUTED_IN_BACKWARD.get(_compat.qualified_op_name(func.overloadpacket))
            rescored = 0 if rescore is None else int(rescore(*args, **kwargs))
            self.add(str(func.overloadpacket), flops, rescored)
        return out

    def _higher_order(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A higher-order operator runs as it would without the count (this mode is set
        aside for it; the work inside it is not seen). FlexAttention's backward arrives so
        when its forward ran eagerly (an eager check, ``force_eager``): :func:`run_unseen`
        priced it already. Another one with a formula in torch's table is priced by it;
        else one that looks costly is named unpriced."""
        out = func(*args, **kwargs)
        name = func.name()
        if self.prepaid[name]:
            self.prepaid[name] -= 1
            return out
        if _PAUSED:
            return out
        formula = _torch_flops.flop_registry.get(func)
        if formula is not None:
            self.add(name, int(formula(*args, **kwargs, out_val=out)))
        elif looks_costly(name):
            self.unpriced[name] += 1
        return out

    def add(self, operator: str, flops: int, rescored: int = 0) -> None:
        """Count ``flops`` of ``operator``, ``rescored`` of which recompute attention scores
        (a fused attention backward's): hardware FLOPs, not model FLOPs."""
        self.total += flops
        self.by_operator[operator] += flops
        # A forward operator inside backward with grad enabled is a recomputation
        # (activation checkpointing); plain backward runs with grad disabled.
        if self.tracker.is_bw and torch.is_grad_enabled():
            self.recomputed += flops
            return
        recomputed = min(flops, rescored)
        self.recomputed += recomputed
        for path in self.tracker.paths():
            self.by_path[path] += flops - recomputed


#: Unpriced operators already warned about: each is said once per process.
_WARNED: set[str] = set()


def _warn_unpriced(unpriced: Counter[str]) -> None:
    new = {name: calls for name, calls in unpriced.items() if name not in _WARNED}
    if not new:
        return
    _WARNED.update(new)
    listed = ", ".join(f"{name} ({calls} call{'s' * (calls != 1)})" for name, calls in new.items())
    rank_zero_warn(
        f"The FLOP count has no formula for {listed}, so counts 0 FLOPs for "
        f"{'it, though by name it is' if len(new) == 1 else 'each, though by name each is'} "
        f"a matrix product, convolution, FFT, recurrent or attention kernel. Where such "
        f"operators carry much of the model's work, count_flops (and SpeedMonitor's FLOPs "
        f"per sample, MFU and HFU) is that much too low. Register a formula with "
        f"`torch.utils.flop_counter.register_flop_formula` (the count reads torch's registry), "
        f"or give SpeedMonitor your own figure with `flops_per_batch=`."
    )


def run_unseen(call: Callable[[], Tensor], flops: Callable[[], KernelFlops]) -> Tensor:
    """``call()`` with the running FLOP count set aside, and priced by ``flops()`` instead.

    For kernels torch refuses to run under a dispatch mode (FlexAttention raises under
    any mode but its own). Outside a count, ``call()`` as it is; inside one, the call runs
    with every dispatch mode set aside, its forward is counted at once, and its backward
    when autograd reaches it, in the module paths of the moment (so a checkpointed
    block's recomputation counts as recomputation, as an operator's would).
    """
    if torch.compiler.is_compiling() or not _ACTIVE:  # traced: no guard on the count
        return call()
    counters = list(_ACTIVE)  # nested counts each see an operator: each gets the price
    cost = None if _PAUSED else flops()
    if cost is not None:  # before the call: a checkpoint's recomputation stops inside
        for counter in counters:  # the call once it has saved its tensors
            counter.add(cost.operator, cost.forward)
    with _compat.dispatch_modes_set_aside():  # every mode: FakeTensorMode too, were one on
        out = call()
    if cost is not None and cost.backward and out.requires_grad:
        out = _CountBackward.apply(out, counters, cost)
    return out


class _CountBackward(torch.autograd.Function):
    """Identity whose backward counts a :class:`KernelFlops`' backward in ``counters``."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, counters: list[_Counter], cost: KernelFlops) -> Tensor:
        ctx.counters, ctx.cost = counters, cost
        return out.clone()  # not a view: the model may write into its attention output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        cost = ctx.cost
        for counter in (c for c in ctx.counters if c in _ACTIVE):
            counter.prepaid[f"{cost.operator}_backward"] += 1  # its kernel, if it comes next
            if not _PAUSED:
                counter.add(f"{cost.operator}_backward", cost.backward, cost.rescored)
        return grad, None, None


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> FlopCount:
    """Run ``fn(*args, **kwargs)`` once and count its FLOPs.

    Count a training step by passing a function that runs forward and backward.
    The call really runs (on whatever device its tensors are on), slower than
    usual because every operator passes through Python.

    Example::

        >>> import torch
        >>> layer = torch.nn.Linear(64, 32, bias=False)
        >>> x = torch.randn(8, 64, requires_grad=True)  # as inside a network
        >>> count_flops(lambda: layer(x).sum().backward()).total == 6 * 64 * 32 * 8
        True
    """
    _validation.function("fn", fn, fix="pass a function that runs the step, e.g. "
                         "`lambda: model(x).sum().backward()`")  # fmt: skip
    tracker = Owners()
    counter = _Counter(tracker)
    with tracker, counter:
        fn(*args, **kwargs)
    by_path = dict(counter.by_path)
    model = counter.total - counter.recomputed
    return FlopCount(
        total=counter.total,
        model=model,
        by_module=top_level(by_path),
        by_operator=dict(sorted(counter.by_operator.items(), key=lambda kv: -kv[1])),
        by_path=by_path,
        unpriced=dict(counter.unpriced),
    )
