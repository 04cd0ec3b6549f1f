"""The parity check's measure: a fused module's outputs and gradients against its own.

A check runs the module's own forward and the fused one on detached copies of the
same inputs (:mod:`._input_copies`: a cache argument copied for each run), each as a
:class:`Run` (its outputs, and the gradients of its inputs and parameters under a fixed
random projection of the outputs), and :meth:`Run.error` compares two runs. The
tolerance a backend must meet comes from the outputs' dtype (:data:`DEFAULT_TOLERANCE`);
in half precision both runs are judged against a float32 run of the module's own
forward (:func:`upcast`). Plain tensors in, plain numbers out: no module is swapped here.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

#: Largest relative error (max |fused - own| / max |own|) that passes, by the
#: lowest floating dtype among the module's outputs.
DEFAULT_TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-7,
    torch.float32: 1e-4,
    torch.bfloat16: 3e-2,
    torch.float16: 1e-2,
}

HALF = (torch.float16, torch.bfloat16)

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
"""A call's positional and keyword arguments."""


def tolerance_for(tensors: list[Tensor]) -> float:
    """The default tolerance for outputs of these dtypes: the loosest among them."""
    dtypes = [t.dtype for t in tensors if t.is_floating_point()]
    return max((DEFAULT_TOLERANCE.get(d, 1e-2) for d in dtypes), default=1e-4)


def is_half(tensors: list[Tensor]) -> bool:
    """Whether any of the tensors is float16 or bfloat16 (then a float32 reference judges)."""
    return any(t.dtype in HALF for t in tensors)


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Eval mode inside (no dropout, no running-stat updates), each module's mode restored."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def upcast(module: nn.Module) -> Iterator[None]:
    """Half-precision parameters and buffers in float32 inside; the same storage after."""
    saved = [(t, t.data) for t in (*module.parameters(), *module.buffers()) if t.dtype in HALF]
    for tensor, data in saved:
        tensor.data = data.float()
    try:
        yield
    finally:
        for tensor, data in saved:
            tensor.data = data


def force_eager() -> contextlib.AbstractContextManager[Any]:
    """torch.compile's ``force_eager`` stance: compiled regions (``RegionalCompile``'s
    blocks) run their own code inside, compiling nothing and guarding on nothing.

    For the kit's own runs of a module (a trace, a parity check, its timing): through a
    compiled block, a check's input shapes, grad mode and eval mode would each compile
    the block once more, towards dynamo's recompile limit. Nothing where the call already
    runs inside torch.compile's frame evaluation without being compiled (a compiled
    ``training_step`` that dynamo runs eagerly, as it does under a counting dispatch
    mode): dynamo refuses a stance change there ("attempted to set_stance in a
    torch.compile region").
    """
    try:
        return torch.compiler.set_stance("force_eager")
    except RuntimeError:  # refused before changing anything
        return contextlib.nullcontext()


#: Keyword arguments that mark a call's padding, Hugging Face's way: ``(batch, seq)``,
#: nonzero at the real tokens; or ``(batch, heads, queries, keys)``, what each query may
#: attend to (``True``, nonzero, or an additive ``0``).
PADDING_MASKS = ("attention_mask",)


def real_positions(
    forward: Callable[..., Any], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor | None:
    """The ``(batch, seq)`` positions of a call that are real tokens, ``True``; ``None``
    when its padding mask marks none as padding (or it has none).

    A padded position's output row is arbitrary: a query with no real key to attend to
    (left padding under a causal mask; right padding past a sliding window) gets
    whatever each kernel makes of a fully masked row (transformers' eager and SDPA
    paths differ there by 0.1 on equal weights), and it reaches no real token's output:
    the next layer reads it only as a key, which the same mask hides. A 2-D mask names
    the padding; a 4-D one, the queries that no key can reach. An encoder-decoder call
    is left whole (strict): its ``attention_mask`` is the encoder's, while its outputs
    are the decoder's.
    """
    named = dict(kwargs)  # a forward taking ``**kwargs`` binds them under one name
    with contextlib.suppress(TypeError, ValueError):  # not introspectable: keywords only
        named.update(inspect.signature(forward).bind_partial(*args, **kwargs).arguments)
    config = getattr(module, "config", None)
    if getattr(config, "is_encoder_decoder", False) or any(k.startswith("decoder_") for k in named):
        return None
    for name in PADDING_MASKS:
        mask = named.get(name)
        if not isinstance(mask, Tensor) or mask.dim() not in (2, 4):
            continue
        # SYNC (here and below): once per module check. A float mask is 1/0 weights, or
        # additive: 0 attends, a very negative value (-inf, the dtype's min) does not.
        if mask.is_floating_point() and bool((mask < 0).any()):
            allowed = mask > torch.finfo(mask.dtype).min / 2
        else:
            allowed = mask != 0
        real = allowed if mask.dim() == 2 else allowed.any(-1).any(1)
        if bool(real.all()) or not bool(real.any()):
            return None  # no padding; or nothing left to compare: the whole call then
        return real
    return None


def _per_position(tensor: Tensor, real: Tensor) -> bool:
    """Whether ``tensor`` holds one row per position of ``real`` (leading ``(batch, seq)``)."""
    return tensor.dim() >= 2 and tensor.shape[:2] == real.shape


class Failure(NamedTuple):
    """A backend that failed a module's check."""

    backend: str
    error: float | None
    """Its parity error; ``None`` where it did not run (refused, raised) or where it
    passed in eval mode and cannot run the training call."""
    why: str


def revert_note(failures: Sequence[Failure], chosen: Failure | None = None) -> tuple[Failure, str]:
    """The failure a revert reports (``chosen``, else the closest miss: the smallest parity
    error, else the first), and the report's note: its reason, and the others tried.

    The report's backend and parity error columns are the reported failure's, so the row
    reads as one verdict (``auto`` tries several backends: the note names them all).
    """
    if not failures:
        return Failure("", None, "no backend could be checked"), "no backend could be checked"
    if chosen is None:
        measured = [f for f in failures if f.error is not None]
        chosen = min(measured, key=lambda f: f.error or 0.0) if measured else failures[0]
    others = [
        f"{f.backend!r} ({f.why if f.error is None else f'parity error {f.error:.2e}'})"
        for f in failures
        if f is not chosen
    ]
    more = f"; also tried: {', '.join(others)}" if others else ""
    return chosen, chosen.why + more


def fsdp2_units(module: nn.Module) -> list[nn.Module]:
    """``module``'s FSDP2 units (``fully_shard``), itself included: a run of it on copies
    of its inputs meets their hooks (their gathers, and in backward their reshards)."""
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def holds_fsdp2_unit(module: nn.Module) -> bool:
    """Whether a submodule of ``module`` is an FSDP2 unit (``fully_shard``): its check
    then runs no backward.

    The backward of a check that runs through an FSDP2 unit's forward ends with FSDP2's
    end-of-backward callback, which reshards every unit of the model, the root included,
    whose forward (the training step around the check) is still running: the root's
    parameters (a Hugging Face model's embedding and head) are then sharded ``DTensor``
    when the forward reads them next. A module that is a unit itself and holds none (an
    attention module sharded on its own) is checked as usual: the check calls its forward
    function, which runs none of FSDP2's hooks.
    """
    return any(unit is not module for unit in fsdp2_units(module))


def tensors(value: Any) -> list[Tensor]:
    """The tensors in ``value`` (nested tuples, lists and mappings), in order."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors(v)]
    return []


class Run:
    """One forward on the check's inputs, and its gradients.

    Args:
        fn: the forward on the check's inputs (the module's own, or a fused one).
        inputs: those inputs: the ones that require grad get gradients.
        module: whose parameters get gradients.
        grad: compute the gradients (a backward under a fixed projection).
        real: the call's real positions (:func:`real_positions`): see :meth:`compared`.
    """

    def __init__(
        self,
        fn: Callable[[], Any],
        inputs: Inputs,
        module: nn.Module,
        grad: bool,
        real: Tensor | None = None,
    ) -> None:
        self.fn = fn
        self.grad = grad
        self.real = real
        output = fn()
        self.not_implemented = output is NotImplemented
        self.tensors = [] if self.not_implemented else tensors(output)
        self.targets = [t for t in tensors(inputs) if t.requires_grad]
        self.n_inputs = len(self.targets)
        self.targets += [p for p in module.parameters() if p.requires_grad]
        self.grads: list[Tensor | None] = []
        if grad and not self.not_implemented:
            self.grads = self.backward(self.tensors)

    def _padded(self) -> Tensor | None:
        """The real positions, where some output has a row per position (else None)."""
        real = self.real
        if real is None or not any(_per_position(t, real) for t in self.tensors):
            return None
        return real

    def compared(self) -> list[Tensor]:
        """The outputs the check compares.

        All of them; but where the call carries padding (``real``) and some output has a
        row per position, those outputs at the real positions only, and no other output.
        Such another output is computed from the padded rows too: a Hugging Face loss on
        a left-padded row reads its last padded position's prediction (the shifted labels
        ask it for the first real token), which each kernel computes from a fully masked
        query as it likes. What the kernel does to the real tokens shows in their rows.
        """
        real = self._padded()
        if real is None:
            return self.tensors
        return [t[real.to(t.device)] for t in self.tensors if _per_position(t, real)]

    def _projections(self, outputs: list[Tensor]) -> list[Tensor]:
        # A fixed random projection of each output: the same for both runs; zero where
        # the comparison leaves the output out (see ``compared``), so that the gradients
        # are those of the outputs compared.
        generator = torch.Generator().manual_seed(1234)
        real = self._padded()
        projections = []
        for o in outputs:
            projection = torch.randn(o.shape, generator=generator, dtype=torch.float32)
            projection = projection.to(o.device, o.dtype)
            if real is not None:
                keep = real if _per_position(o, real) else torch.zeros((), dtype=torch.bool)
                keep = keep.reshape((*keep.shape, *[1] * (o.dim() - keep.dim())))
                projection = projection * keep.to(o.device, o.dtype)
            projections.append(projection)
        return projections

    def backward(self, outputs: list[Tensor]) -> list[Tensor | None]:
        """The gradients of the inputs and parameters under the fixed projection."""
        differentiable = [t for t in outputs if t.requires_grad]
        if not differentiable or not self.targets:
            return []
        return list(
            torch.autograd.grad(
                differentiable,
                self.targets,
                self._projections(differentiable),
                allow_unused=True,
            )
        )

    def again(self) -> None:
        """The forward (+ backward) once more, results dropped (for timing)."""
        output = tensors(self.fn())
        if self.grad:
            self.backward(output)

    def error(self, other: Run) -> float:
        """Largest relative error of ``other``'s outputs and gradients against ours.

        Outputs and input gradients: each tensor's largest error, scaled by its
        own largest value, floored at 1% of the largest value in its group. On a padded
        call, the outputs with a row per position at the real positions only (see
        :meth:`compared`); input gradients whole (a padded input's gradient would reach
        the parameters of whatever computed it).

        Parameter gradients: the error of the module's whole parameter gradient,
        one vector (relative L2), as an optimizer step sees it, whatever the
        module's packing. Per tensor, a gradient that is small against the rest
        weighs its rounding with its own size: at initialisation the query and
        key projections' gradients of a nearly uniform attention are hundreds of
        times smaller than the value and output projections' (differences of
        nearly equal scores), and the backward of every fused kernel in half
        precision (FlashAttention's row sums taken from the rounded output) puts
        a rounding error of tens of percent of their own size on them. That
        failed separate ``q_proj``/``k_proj`` projections and passed a fused
        ``qkv``, where the same error hides beside the value part; the module's
        whole gradient moves by the same amount (rounding) with any kernel.
        """
        if len(self.tensors) != len(other.tensors) or len(self.grads) != len(other.grads):
            return math.inf
        n = self.n_inputs
        ours, theirs = self.compared(), other.compared()
        if len(ours) != len(theirs):
            return math.inf
        outputs = relative_errors(list(zip(ours, theirs, strict=True)))
        inputs = relative_errors(list(zip(self.grads[:n], other.grads[:n], strict=True)))
        params = vector_error(list(zip(self.grads[n:], other.grads[n:], strict=True)))
        if outputs is None or inputs is None or params is None:
            return math.inf
        errors = [e for e in (outputs, inputs, params) if e.numel()]
        if not errors:
            return 0.0
        return float(torch.cat(errors).max())  # SYNC: once per module check


def _aligned(
    pairs: list[tuple[Tensor | None, Tensor | None]],
) -> list[tuple[Tensor, Tensor]] | None:
    """The pairs with both sides present, ``None`` where a pair's shapes differ. A side
    missing is zeros: an input unused on one side only has a zero gradient."""
    aligned: list[tuple[Tensor, Tensor]] = []
    for ours, theirs in pairs:
        if ours is None and theirs is None:
            continue
        if ours is None:
            assert theirs is not None
            ours = torch.zeros_like(theirs)
        if theirs is None:
            theirs = torch.zeros_like(ours)
        if ours.shape != theirs.shape:
            return None
        aligned.append((ours, theirs))
    return aligned


def relative_errors(pairs: list[tuple[Tensor | None, Tensor | None]]) -> Tensor | None:
    """Per-pair relative errors (see :meth:`Run.error`); ``None`` for a shape mismatch."""
    aligned = _aligned(pairs)
    if aligned is None:
        return None
    diffs: list[Tensor] = []
    scales: list[Tensor] = []
    for ours, theirs in aligned:
        if not ours.is_floating_point():
            same = torch.equal(ours, theirs)
            diffs.append(torch.tensor(0.0 if same else math.inf))
            scales.append(torch.tensor(1.0))
            continue
        a, b = ours.detach().float(), theirs.detach().float()
        diff = (a - b).abs()
        diff = torch.where(a.isnan() & b.isnan(), torch.zeros_like(diff), diff)
        diffs.append(torch.nan_to_num(diff, nan=math.inf).max().cpu())
        scales.append(torch.nan_to_num(a.abs(), nan=0.0).max().cpu())
    if not diffs:
        return torch.zeros(0)
    diff, scale = torch.stack(diffs), torch.stack(scales)
    floor = (scale.max() * 0.01).clamp_min(1e-12)
    return diff / torch.maximum(scale, floor)


def vector_error(pairs: list[tuple[Tensor | None, Tensor | None]]) -> Tensor | None:
    """``|theirs - ours| / |ours|`` over all pairs as one vector (L2); ``None``: shapes differ."""
    aligned = _aligned(pairs)
    if aligned is None:
        return None
    diff_sq: list[Tensor] = []
    ref_sq: list[Tensor] = []
    for ours, theirs in aligned:
        a, b = ours.detach().double(), theirs.detach().double()
        diff = torch.where(a.isnan() & b.isnan(), torch.zeros_like(a), a - b)
        diff_sq.append(torch.nan_to_num(diff.square().sum(), nan=math.inf).cpu())
        ref_sq.append(torch.nan_to_num(a.square().sum(), nan=0.0).cpu())
    if not diff_sq:
        return torch.zeros(0)
    diff_norm = torch.stack(diff_sq).sum().sqrt()
    ref_norm = torch.stack(ref_sq).sum().sqrt().clamp_min(1e-30)
    return (diff_norm / ref_norm).float().reshape(1)
