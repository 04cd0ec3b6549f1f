"""Counting the FLOPs of a function: total, per module, model versus hardware.

``count_flops(fn, *args)`` runs ``fn`` once under a dispatch mode that prices
every ATen operator with torch's own formulas (``torch.utils.flop_counter``),
plus formulas torch lacks: its CPU flash-attention kernel (which torch counts as
0) and flash-attn's kernels. Only matrix products and attention are priced, as
in torch and in the MFU literature; element-wise work is free.

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
import dataclasses
import itertools
import math
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils import flop_counter as _torch_flops

from lightning_speedkit import _compat, _validation
from lightning_speedkit._compat import TorchDispatchMode

if TYPE_CHECKING:
    from lightning_speedkit._compat import OpOverload

__all__ = ["FlopCount", "count_flops"]

_Formula = Callable[..., int]
_aten = torch.ops.aten


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


def _formula_for(func: OpOverload) -> _Formula | None:
    packet = func.overloadpacket
    formula = _torch_flops.flop_registry.get(packet)
    if formula is not None:
        return formula
    return EXTRA_FORMULAS.get(_compat.qualified_op_name(packet))


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
    """

    total: int
    model: int
    by_module: dict[str, int] = field(default_factory=dict)
    by_operator: dict[str, int] = field(default_factory=dict)
    by_path: dict[str, int] = field(default_factory=dict)

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


#: Key of an autograd node's ``metadata``: the module paths whose forward created it.
_OWNER = "lightning_speedkit.owner"


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a batch or a module's output, in order, through what Lightning's
    ``apply_to_collection`` walks: mappings (``dict``, Hugging Face's ``BatchEncoding`` and
    ``ModelOutput``, a ``UserDict``), lists and tuples (named ones too), and dataclass
    instances."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for each in dataclasses.fields(value):
            yield from _tensors(getattr(value, each.name, None))


def _metadata(node: Any) -> dict[str, Any]:
    """An autograd node's ``metadata`` dict (a property; torch's stub says a method)."""
    metadata: dict[str, Any] = node.metadata
    return metadata


class _Owners:
    """Which module owns each operator: the module whose forward runs it, or, in backward,
    the module whose forward created the autograd node being run.

    Forward: a stack of the modules being called (global forward hooks), innermost
    last. Backward: when a module's forward returns, every autograd node its call
    created and its outputs reach, not yet claimed by a module inside it, is labelled
    with the stack (the node's ``metadata``); the backward operators of that node go
    to those modules. One owner per operator, so the modules' FLOPs add up. (torch's
    ``ModuleTracker`` keeps a set of the modules whose backward has begun and not
    ended, which during backward holds siblings at once: two branches were both
    credited with each other's backward.)
    """

    def __init__(self) -> None:
        self._stack: list[tuple[str, int]] = []  # (path, sequence number at its call)
        self._names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._seen: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._handles: list[Any] = []

    @property
    def is_bw(self) -> bool:
        """Whether autograd is running a backward pass now."""
        return _compat.autograd_running()

    def _node_owner(self) -> tuple[str, ...]:
        """Owner of the autograd node running now; () outside backward or when unknown."""
        if not self.is_bw:
            return ()
        node = _compat.current_autograd_node()
        return _metadata(node).get(_OWNER, ()) if node is not None else ()

    def _owner(self) -> tuple[str, ...]:
        # A forward run inside backward (a checkpoint's recomputation) belongs below the
        # modules that owned the node being run, whose own calls are over.
        return (*self._node_owner(), *(path for path, _ in self._stack))

    def paths(self) -> tuple[str, ...]:
        """The owning module and its callers, outermost first (``Global`` always), each
        once: a module that calls itself (recursion, a checkpoint's recomputation under
        the node's owner) is credited once per operator."""
        if self.is_bw and not torch.is_grad_enabled():
            return tuple(dict.fromkeys(("Global", *self._node_owner())))
        return tuple(dict.fromkeys(("Global", *self._owner())))

    def _name(self, module: torch.nn.Module) -> str:
        # As torch's ModuleTracker names them: the first module seen by its class, and
        # its descendants by attribute path below it.
        name = self._names.get(module)
        if name is None:
            name = self._names[module] = type(module).__name__
        if module not in self._seen:
            self._seen.add(module)
            for child_name, child in module.named_children():
                self._names[child] = f"{name}.{child_name}"
                self._name(child)
        return name

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        self._stack.append((self._name(module), _compat.autograd_sequence_nr()))

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._stack:
            return
        owner = self._owner()
        _, start = self._stack.pop()
        # Nodes this call created have sequence numbers from `start` on (the counter is
        # per thread, and a forward runs on one); older nodes are the inputs' history.
        # (`requires_grad` first: reading a tensor's `grad_fn` can make a lazy tensor
        # subclass, as AttentionSwap's traced placeholders, compute itself.)
        todo = [t.grad_fn for t in _tensors(output) if t.requires_grad]
        seen: dict[int, Any] = {}  # holds the nodes, so that their ids stay theirs
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen or _compat.node_sequence_nr(node) < start:
                continue
            seen[id(node)] = node
            _metadata(node).setdefault(_OWNER, owner)  # a module inside got there first
            todo.extend(next_node for next_node, _ in node.next_functions)

    def __enter__(self) -> _Owners:
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack.clear()


class _Counter(TorchDispatchMode):
    def __init__(self, tracker: _Owners) -> None:
        super().__init__()
        self.tracker = tracker
        self.total = 0
        self.recomputed = 0
        self.by_operator: dict[str, int] = defaultdict(int)
        self.by_path: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _formula_for(func)
        if formula is None or _PAUSED:
            return out
        flops = int(formula(*args, **kwargs, out_val=out))
        if not flops:
            return out
        self.total += flops
        self.by_operator[str(func.overloadpacket)] += flops
        # A forward operator inside backward with grad enabled is a recomputation
        # (activation checkpointing); plain backward runs with grad disabled.
        if self.tracker.is_bw and torch.is_grad_enabled():
            self.recomputed += flops
            return out
        rescore = RECOMPUTED_IN_BACKWARD.get(_compat.qualified_op_name(func.overloadpacket))
        if rescore is not None:
            recomputed = min(flops, int(rescore(*args, **kwargs)))
            self.recomputed += recomputed
            flops -= recomputed
        for path in self.tracker.paths():
            self.by_path[path] += flops
        return out


def _children(by_path: dict[str, int], node: str) -> dict[str, int]:
    """FLOPs of ``node``'s direct children, by name.

    A container (``nn.ModuleList``, ``nn.ModuleDict``) is never called, so it has no
    entry of its own: its FLOPs are those of its shallowest called descendants (a
    nanoGPT's ``transformer`` ModuleDict gathers ``wte``, ``h.0``..``h.11``, ``ln_f``).
    """
    prefix = node + "."
    below = {p[len(prefix) :]: f for p, f in by_path.items() if p.startswith(prefix)}
    children: dict[str, int] = defaultdict(int)
    for path, flops in below.items():
        parts = path.split(".")
        if any(".".join(parts[:depth]) in below for depth in range(1, len(parts))):
            continue  # counted in a called ancestor below the node
        children[parts[0]] += flops
    return dict(children)


def _top_level(by_path: dict[str, int]) -> dict[str, int]:
    """Children of the first node that does not hand (nearly) all its FLOPs to one child."""
    roots = {p: f for p, f in by_path.items() if p != "Global" and "." not in p}
    if len(roots) != 1:
        return dict(sorted(roots.items(), key=lambda kv: -kv[1]))
    ((node, total),) = roots.items()
    while True:
        children = _children(by_path, node)
        if len(children) == 1 and math.isclose(next(iter(children.values())), total, rel_tol=0.01):
            ((name, total),) = children.items()
            node = f"{node}.{name}"
            continue
        rest = total - sum(children.values())
        if rest > 0:
            children["(own operators)"] = rest
        return dict(sorted(children.items(), key=lambda kv: -kv[1]))


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
    tracker = _Owners()
    counter = _Counter(tracker)
    with tracker, counter:
        fn(*args, **kwargs)
    by_path = dict(counter.by_path)
    model = counter.total - counter.recomputed
    return FlopCount(
        total=counter.total,
        model=model,
        by_module=_top_level(by_path),
        by_operator=dict(sorted(counter.by_operator.items(), key=lambda kv: -kv[1])),
        by_path=by_path,
    )
