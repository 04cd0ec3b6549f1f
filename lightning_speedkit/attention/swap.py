"""``swap_attention``: make a model's attention run a fused backend, checked.

How a swap works:

1. Every module is offered to the adapters (:mod:`.adapters`); the first that
   claims it replaces the module's ``forward`` on the instance (through
   :mod:`lightning_speedkit._surgery`), so parameters, buffers, state_dict keys
   and the optimizer's references are untouched. The modules no adapter claims
   are probed: the first call that reaches one is traced, and the attention it
   computes is swapped where it was found (the ``traced`` family, :mod:`._traced`).
2. Parity: the first time a swapped module runs on real inputs, it runs its own
   forward *and* the fused one on copies of those inputs (in eval mode, so
   dropout is off), compares the outputs and, when gradients are enabled, the
   gradients of inputs and parameters under a fixed random projection of the
   output (see :meth:`_Run.error` for the measure). In half precision both are
   measured against a float32 run of the module's own forward (the eager softmax
   in bf16 is itself far from exact): a backend passes within the tolerance or
   within twice the module's own error.
   A module whose error exceeds that is reverted, with a warning. The checked
   call returns the fused output when the check passes (equal within the
   tolerance; a recomputation under activation checkpointing then runs what the
   forward ran) and the module's own output otherwise. Without a sample, each module is
   also checked at swap time on a small synthetic input of its own.
3. ``backend="auto"`` times the candidate backends on those real inputs, with
   backward, and keeps the fastest that passes.
4. Under ``torch.distributed``, :func:`agree_across_ranks` makes every rank run
   rank 0's decisions (AttentionSwap calls it after the first training batch).

The report is live: entries fill in as modules are checked.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_speedkit import _validation
from lightning_speedkit._surgery import (
    original_forward,
    refuse_wrapped,
    replace_forward,
    replaced_forward,
    restore_forward,
)
from lightning_speedkit.attention._discovery import Discovery, Found, probed
from lightning_speedkit.attention._traced import SwapRefusedError, TracedAttention, swapped_call
from lightning_speedkit.attention.adapters import TRACED, AttentionAdapter, SwapContext, adapters
from lightning_speedkit.attention.backends import (
    BACKENDS,
    Attend,
    BackendChoice,
    auto_candidates,
    check_backend,
)
from lightning_speedkit.errors import SpeedkitConfigError
from lightning_speedkit.measure.flops import not_counted

log = logging.getLogger(__name__)

Status = Literal["pending", "active", "reverted"]

#: Largest relative error (max |fused - own| / max |own|) that passes, by the
#: lowest floating dtype among the module's outputs.
DEFAULT_TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-7,
    torch.float32: 1e-4,
    torch.bfloat16: 3e-2,
    torch.float16: 1e-2,
}


@dataclass
class ModuleSwap:
    """One swapped attention module, as checked so far."""

    name: str
    family: str
    requested: str
    backend: str | None = None
    """The backend that runs (``auto``'s pick; a fallback says so)."""
    status: Status = "pending"
    parity_error: float | None = None
    """Largest relative error over outputs and gradients in the latest check."""
    speedup: float | None = None
    """Own forward(+backward) time / fused time, on the checked inputs."""
    checked: str = ""
    """What the latest passed check covered: ``synthetic``, ``forward`` or ``forward+backward``."""
    reason: str = ""
    """Why it was reverted."""
    detail: str = ""
    """What discovery saw in the module (``traced`` family): heads, projections, masks."""
    ranks: str = ""
    """On rank 0, once the ranks agreed: what other ranks had decided for this module."""


@dataclass
class SwapReport:
    """What :func:`swap_attention` did; entries update as modules are checked."""

    backend: str
    modules: list[ModuleSwap] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """Modules of a known family that cannot be swapped, with the reason."""
    _swaps: dict[str, _SwappedForward] = field(default_factory=dict, repr=False, compare=False)
    _decided: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False, compare=False)
    """Decisions for modules not found yet (a resumed run's, for traced modules)."""

    @property
    def swapped(self) -> list[str]:
        """Names of the modules whose attention now runs the fused backend."""
        return [m.name for m in self.modules if m.status != "reverted"]

    @property
    def reverted(self) -> list[tuple[str, str]]:
        """Modules that failed their parity check, with the reason; they run their own forward."""
        return [(m.name, m.reason) for m in self.modules if m.status == "reverted"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "modules": [asdict(m) for m in self.modules],
            "skipped": [list(pair) for pair in self.skipped],
        }

    def to_markdown(self) -> str:
        lines = [
            "| module | family | backend | status | parity error | speedup | note |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in self.modules:
            error = "-" if m.parity_error is None else f"{m.parity_error:.1e}"
            speedup = "-" if m.speedup is None else f"{m.speedup:.2f}x"
            note = m.reason or (f"checked: {m.checked}" if m.checked else "not called yet")
            note = "; ".join(part for part in (note, m.detail, m.ranks) if part)
            lines.append(
                f"| {m.name or '(root)'} | {m.family} | {m.backend or m.requested} | {m.status} "
                f"| {error} | {speedup} | {note} |"
            )
        for name, reason in self.skipped:
            lines.append(f"| {name or '(root)'} | - | - | skipped | - | - | {reason} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()


def swap_attention(
    model: nn.Module,
    backend: BackendChoice = "sdpa",
    sample: Any = None,
    *,
    tolerance: float | None = None,
    measure: bool = True,
) -> SwapReport:
    """Make every attention module of ``model`` run a fused backend, parity-checked.

    Modules of a known family are swapped now; the others are probed, and the
    first call that reaches them is traced: attention found there (two products
    around a softmax, fed by projections) is swapped in the module that holds it
    (the ``traced`` family) and checked on that call's inputs.

    Args:
        model: any ``nn.Module``, not yet wrapped by DDP/FSDP/DeepSpeed or compiled
            (compile after swapping).
        backend: ``"sdpa"`` (PyTorch picks the kernel: start here), ``"flash"``,
            ``"efficient"``, ``"cudnn"``, ``"flex"``, ``"math"``, or ``"auto"`` (time
            the candidates on the first real inputs, keep the fastest that passes).
            A backend the device cannot run falls back to ``"sdpa"``, said once.
            The default is ``"sdpa"`` where :class:`~lightning_speedkit.AttentionSwap`'s
            is ``"auto"``: ``auto`` picks by timing, which can pick differently on each
            rank and in each run. The callback makes every rank take rank 0's picks
            after the first batch and keeps them in checkpoints; called on its own,
            nothing does that for you (:func:`agree_across_ranks` is the first half), so
            the default here is the backend that times nothing.
        sample: what ``model`` is called with: a tensor, a tuple of positional
            arguments or a dict of keyword arguments. The model runs it once (in
            eval mode, output discarded) so that each swapped module is checked,
            and attention no family names is found, on real inputs now rather
            than at the model's first call.
        tolerance: largest relative error that passes; default by dtype
            (:data:`DEFAULT_TOLERANCE`: 1e-4 in fp32, 3e-2 in bf16).
        measure: time the module's own forward(+backward) against the fused one
            at the check, for the report's ``speedup`` (``"auto"`` always times).

    A deep copy of ``model`` (an EMA or ``AveragedModel`` copy, a teacher) is a model
    of its own: its swaps are copies, and a module first called on it is found,
    swapped and checked there and recorded in the copy's own copy of the report
    (:func:`swapped_modules` of the copy lists its swaps and their entries), never in
    the report returned here.

    Returns:
        A :class:`SwapReport`: ``.swapped``, ``.reverted``, ``.skipped``, ``.modules``.

    Example::

        >>> from torch import nn
        >>> layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, batch_first=True)
        >>> report = swap_attention(layer, sample=torch.randn(2, 5, 16))
        >>> report.swapped
        ['self_attn']
        >>> report.modules[0].family, report.modules[0].checked
        ('multihead_attention', 'forward+backward')
    """
    fix = "pass the model (or LightningModule) whose attention to swap"
    _validation.instance("model", model, nn.Module, what="a torch.nn.Module", fix=fix)
    check_backend(backend)
    _validation.optional(_validation.positive_number, "tolerance", tolerance, example=1e-3)
    _validation.boolean("measure", measure)
    refuse_wrapped(model, "swap_attention")
    report = SwapReport(backend)
    swaps, excluded = _swap_modules(model, report, backend, tolerance, measure)
    discovery = _discover(model, report, excluded, backend, tolerance, measure)
    if not swaps and not report.skipped and discovery is None:
        _warn_nothing_found(type(model).__name__)
    if sample is not None:
        with _eval(model), torch.enable_grad():
            _call(model, sample)  # checks the swaps; the first call of probed modules is traced
    else:
        for swap in swaps:
            swap.check_synthetic()
    return report


def _warn_nothing_found(what: str) -> None:
    rank_zero_warn(
        f"swap_attention found no attention module in {what}: none of the known families "
        "(nn.MultiheadAttention, timm, Hugging Face, q/k/v + output projections with a head "
        "count), and its first call computed no softmax between two products of projected "
        "inputs. Teach it with `lightning_speedkit.register_adapter`."
    )


def _swap_modules(
    model: nn.Module,
    report: SwapReport,
    backend: str,
    tolerance: float | None,
    measure: bool,
) -> tuple[list[_SwappedForward], list[str]]:
    """The adapters' swaps, and the names of the subtrees a traced swap must leave alone."""
    swaps: list[_SwappedForward] = []
    excluded: list[str] = []  # swapped, or refused by a family that knows them
    owners: list[tuple[str, AttentionAdapter, Any]] = []  # claimed subtrees
    for name, module in model.named_modules():
        owners = [o for o in owners if o[0] == "" or name.startswith(o[0] + ".")]
        if replaced_forward(module) is not None:
            report.skipped.append((name, "already swapped"))
            excluded.append(name)
            continue
        for adapter in adapters():
            if owners and adapter is not owners[-1][1]:
                continue  # inside a swapped module only its own family looks further
            binding = adapter.match(module)
            if binding is None:
                continue
            if any(binding is owner[2] for owner in owners):
                break  # the same model as an enclosing swap (a shared config)
            if isinstance(binding, str):
                report.skipped.append((name, binding))
                if adapter.family != "structural":  # names only: a trace may still find it
                    excluded.append(name)
                break
            entry = ModuleSwap(name=name, family=adapter.family, requested=backend)
            swap = _SwappedForward(module, entry, adapter, binding, tolerance, measure)
            replace_forward(module, swap)
            report.modules.append(entry)
            report._swaps[name] = swap
            swaps.append(swap)
            owners.append((name, adapter, binding))
            excluded.append(name)
            break
    return swaps, excluded


def _discover(
    model: nn.Module,
    report: SwapReport,
    excluded: list[str],
    backend: str,
    tolerance: float | None,
    measure: bool,
) -> Discovery | None:
    """Probe the modules no adapter claimed; ``None`` when there are none."""

    def inside(name: str, top: str) -> bool:
        return top == "" or name == top or name.startswith(top + ".")

    # The modules that hold another family's swap are not traced either: what they compute
    # besides it would be found in their own submodules, and the model's first call stays
    # untraced where the known families found everything.
    holders = {
        ".".join(top.split(".")[:i]) for top in excluded if top for i in range(len(top.split(".")))
    }
    # Pairs, not a dict keyed by module: a module's own hash may read its state (a
    # torchmetrics Metric's does), and its ``==`` may be always true (a Metric's is).
    candidates: list[tuple[nn.Module, str]] = []
    for name, module in model.named_modules():
        if name in holders or any(inside(name, top) for top in excluded) or probed(module):
            continue
        if type(module).__module__.startswith("torch.") and not any(
            True for _ in module.children()
        ):
            continue  # one of torch's own layers (Linear, LayerNorm, Dropout, ...)
        candidates.append((module, name))
    if not candidates:
        return None
    traced = _TracedSwaps(report, type(model).__name__, backend, tolerance, measure)
    return Discovery(model, candidates, traced)


class _TracedSwaps:
    """What discovery finds, swapped, checked and recorded in ``report`` (the ``traced`` family).

    Held by the model's discovery, and deep-copied with it: a deep copy of the model
    (an EMA or ``AveragedModel`` copy) swaps what it finds in itself and records it in
    its own copy of the report, never in this one.
    """

    def __init__(
        self,
        report: SwapReport,
        model_name: str,
        backend: str,
        tolerance: float | None,
        measure: bool,
    ) -> None:
        self.report = report
        self.model_name = model_name
        self.backend = backend
        self.tolerance = tolerance
        self.measure = measure
        self.warned = False

    def install(self, found: Found, name: str) -> None:
        report, backend = self.report, self.backend
        entry = ModuleSwap(name=name, family="traced", requested=backend, detail=found.detail)
        binding = TracedAttention(found.detail)
        swap = _SwappedForward(found.owner, entry, TRACED, binding, self.tolerance, self.measure)
        replace_forward(found.owner, swap)
        report.modules.append(entry)
        report._swaps[name] = swap
        report.skipped[:] = [(n, why) for n, why in report.skipped if n != name]
        decision = report._decided.pop(name, None)
        if decision is not None:  # decided in the run this one resumes
            swap.adopt(decision, "in the run this one resumes", pin=backend == "auto", trust=False)
        if entry.status != "reverted":
            swap.check_now(*found.inputs, grad=found.grad)

    def nothing_found(self, name: str) -> None:
        report = self.report
        if not report.modules and not report.skipped and not self.warned:
            self.warned = True
            _warn_nothing_found(self.model_name)


def _call(model: nn.Module, sample: Any) -> Any:
    if isinstance(sample, Tensor):
        return model(sample)
    if isinstance(sample, tuple):
        return model(*sample)
    if isinstance(sample, Mapping):
        return model(**sample)
    raise SpeedkitConfigError(
        f"`sample` must be a tensor, a tuple of positional arguments or a dict of keyword "
        f"arguments (what the model is called with), got {type(sample).__name__}."
    )


@contextlib.contextmanager
def _eval(module: nn.Module) -> Iterator[None]:
    """Eval mode inside (no dropout, no running-stat updates), each module's mode restored."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


class _SwappedForward:
    """The forward ``swap_attention`` puts on a module: fused once checked, own until then."""

    _speedkit = True

    def __init__(
        self,
        module: nn.Module,
        entry: ModuleSwap,
        adapter: AttentionAdapter,
        binding: Any,
        tolerance: float | None,
        measure: bool,
    ) -> None:
        self.module = module
        self.entry = entry
        self.adapter = adapter
        self.original = original_forward(module)
        self.tolerance = tolerance
        self.measure = measure
        self._attends: dict[str, Attend] = {}
        first = "sdpa" if entry.requested == "auto" else entry.requested
        self.ctx = SwapContext(module, self.original, self._attend(first), binding)
        self.checked_forward = False
        self.checked_backward = False
        self._pinned = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # checks run eagerly; a traced call takes what passed
            if self.entry.status == "active":
                return self._fast(self.ctx, args, kwargs)
            return self.original(*args, **kwargs)
        grad = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        with swapped_call():  # an enclosing module's trace or fusion does not look in here
            if not self.checked_forward or (grad and not self.checked_backward):
                return self._check_call(args, kwargs, grad)
            return self._fast(self.ctx, args, kwargs)

    def _fast(self, ctx: SwapContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = self.adapter.forward(ctx, *args, **kwargs)
        if out is NotImplemented:
            return self.original(*args, **kwargs)
        return out

    def _attend(self, backend: str) -> Attend:
        if backend not in self._attends:
            self._attends[backend] = Attend(backend)
        return self._attends[backend]

    # ------------------------------------------------------------------ checks

    def check_synthetic(self) -> None:
        """Check on the adapter's own small input (no timing): catches look-alikes early."""
        if self.adapter.example_inputs is None:
            return
        example = self.adapter.example_inputs(self.module)
        if example is None:
            return
        with _eval(self.module), torch.enable_grad():
            self._check(example[0], example[1], grad=True, time_it=False, label="synthetic")

    def _check_call(self, args: tuple[Any, ...], kwargs: dict[str, Any], grad: bool) -> Any:
        if self._check_inputs(args, kwargs, grad):
            # The fused output (equal within the tolerance): a recomputation under activation
            # checkpointing then runs the same operations as this forward did.
            return self._fast(self.ctx, args, kwargs)
        return self.original(*args, **kwargs)

    def check_now(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, grad: bool) -> None:
        """Check on inputs the module was just called with (a traced module's first call)."""
        with torch.set_grad_enabled(grad), swapped_call():
            self._check_inputs(args, kwargs, grad)

    def _check_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any], grad: bool) -> bool:
        # The check is not the model's work: no FLOPs counted, and what its runs save for
        # backward stays theirs (an enclosing activation checkpoint must not count it).
        modes = [(m, m.training) for m in self.module.modules()]
        with _eval(self.module), not_counted(), _keep_saved_tensors():
            passed = self._check(
                args,
                kwargs,
                grad,
                time_it=True,  # auto always times its candidates; one backend only if measure
                label="forward+backward" if grad else "forward",
                training=modes if any(training for _, training in modes) else None,
            )
        if passed:
            self.checked_forward = True
            self.checked_backward = self.checked_backward or grad
        return passed

    def _check(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        grad: bool,
        *,
        time_it: bool,
        label: str,
        training: list[tuple[nn.Module, bool]] | None = None,
    ) -> bool:
        """Compare fused against own on copies of these inputs; revert on failure.

        Compared in eval mode (no dropout, the same numbers both ways); ``training``, the
        modes of a module called in training, has each passing backend also run once
        in them, to drop one that cannot (the CPU's flash kernel has no dropout).

        Returns whether a check happened and passed (the adapter may not handle
        these inputs: then nothing is decided).
        """
        entry = self.entry
        copies = _copy_inputs(args, kwargs, requires_grad=grad)
        try:
            own = _Run(lambda: self.original(*copies[0], **copies[1]), copies, self.module, grad)
        except Exception:
            if label != "synthetic":
                raise  # the module's own forward fails on its real inputs: the user's error
            # Its forward wants other inputs than the adapter's example: check at first call.
            log.debug("no synthetic check for %s", entry.name, exc_info=True)
            return False
        if not own.tensors:
            return False
        requested = entry.requested
        if requested == "auto" and label != "synthetic" and not self._pinned:
            candidates: Sequence[str] = auto_candidates(own.tensors[0].device)
        else:
            candidates = [self.ctx.attend.backend]
        tolerance = self.tolerance or _tolerance(own.tensors)
        reference = self._reference(args, kwargs, grad) if _half(own.tensors) else None
        if reference is not None:  # judge both against float32, not fused against eager
            tolerance = max(tolerance, 2 * reference.error(own))
        passing: list[tuple[str, float, _Run]] = []
        failure = ""
        for backend in candidates:
            ctx = SwapContext(
                self.module, self.original, self._attend(backend), self.ctx.binding, checking=True
            )
            try:
                fused = _Run(_bind(self.adapter.forward, ctx, copies), copies, self.module, grad)
            except SwapRefusedError as error:
                failure = str(error)
                continue
            except Exception as error:
                failure = f"the fused forward raised {type(error).__name__}: {error}"
                continue
            if fused.not_implemented:
                return False
            error_value = (reference or own).error(fused)
            if error_value <= tolerance:
                passing.append((backend, error_value, fused))
            elif not failure or error_value < math.inf:
                failure = (
                    f"parity error {error_value:.2e} > tolerance {tolerance:.1e} "
                    f"on {label} inputs with backend {backend!r}"
                )
        if training is not None:
            runs = [(p, self._fails_in_training(p[0], copies, training)) for p in passing]
            passing = [p for p, why in runs if why is None]
            failure = next((why for _, why in runs if why is not None), failure)
        if not passing:
            self._revert(failure)
            return False
        if time_it and (len(passing) > 1 or self.measure):
            own_time = own.time()
            timed = [(fused.time(), backend, err) for backend, err, fused in passing]
            best_time, backend, error_value = min(timed)
            entry.speedup = own_time / best_time if best_time > 0 else None
        else:
            backend, error_value, _ = passing[0]
        attend = self._attend(backend)
        self.ctx = SwapContext(self.module, self.original, attend, self.ctx.binding)
        entry.backend = attend.describe(own.tensors[0].device)
        entry.parity_error = error_value
        entry.checked = label
        entry.status = "active"
        return True

    def _fails_in_training(
        self,
        backend: str,
        inputs: tuple[tuple[Any, ...], dict[str, Any]],
        modes: list[tuple[nn.Module, bool]],
    ) -> str | None:
        """Why ``backend`` cannot run the module's training call, or None if it can.

        One forward in the module's training modes (dropout on), without gradients; the
        random state and the buffers (running statistics) are put back after it, so
        training draws and computes what it would have.
        """
        ctx = SwapContext(
            self.module, self.original, self._attend(backend), self.ctx.binding, checking=True
        )
        cuda = sorted({t.device.index or 0 for t in _tensors(inputs) if t.device.type == "cuda"})
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        try:
            with torch.random.fork_rng(devices=cuda), torch.no_grad():
                for m, training in modes:
                    m.training = training
                _bind(self.adapter.forward, ctx, inputs)()
        except Exception as error:
            return (
                f"backend {backend!r} cannot run the training call "
                f"({type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]})"
            )
        finally:
            self.module.eval()  # the check goes on in eval mode; its caller restores modes
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
        return None

    def _reference(self, args: tuple[Any, ...], kwargs: dict[str, Any], grad: bool) -> _Run | None:
        """The module's own forward in float32: inputs, parameters and buffers upcast."""
        copies = _copy_inputs(args, kwargs, requires_grad=grad, upcast=True)
        device = next((t.device for t in _tensors(copies)), torch.device("cpu"))
        try:
            with _upcast(self.module), torch.autocast(device.type, enabled=False):
                return _Run(
                    lambda: self.original(*copies[0], **copies[1]), copies, self.module, grad
                )
        except Exception:  # a forward that insists on its dtype: compare with eager alone
            log.debug("no float32 reference for %s", self.entry.name, exc_info=True)
            return None

    def pin(self, backend: str) -> None:
        """Run ``backend`` from now on (a resumed run keeps ``auto``'s earlier pick)."""
        self._pinned = True
        self.ctx = SwapContext(self.module, self.original, self._attend(backend), self.ctx.binding)

    def revert(self, reason: str) -> None:
        """Give the module its own forward back."""
        self._revert(reason)

    def adopt(self, decision: Mapping[str, Any], source: str, *, pin: bool, trust: bool) -> None:
        """Take a decision made elsewhere as this module's (see :func:`_decision`).

        Args:
            decision: what was decided: reverted (and why), or active with a backend.
            source: where it was decided, for the report ("on rank 0", ...).
            pin: run the decided backend (``auto``'s pick) rather than timing again.
            trust: take its checks as done here (the ranks agree); else check again.
        """
        status = decision.get("status")
        if status == "reverted":
            if self.entry.status != "reverted":
                self._revert(f"reverted {source}: {decision.get('reason', '')}")
            return
        if status != "active":
            return
        if replaced_forward(self.module) is not self:  # reverted here: swapped again
            replace_forward(self.module, self)
        backend = str(decision.get("backend") or "").split(" ", 1)[0]  # "sdpa (...)" ran sdpa
        if pin and backend in BACKENDS:
            self.pin(backend)
        entry = self.entry
        entry.status = "active"
        entry.reason = ""
        if trust:
            checked = str(decision.get("checked", ""))
            self.checked_forward = checked in ("forward", "forward+backward")
            self.checked_backward = checked == "forward+backward"
            entry.checked = checked
            entry.backend = decision.get("backend")
            entry.parity_error = decision.get("parity_error")
            entry.speedup = decision.get("speedup")

    def _revert(self, reason: str) -> None:
        restore_forward(self.module, self)
        self.entry.status = "reverted"
        self.entry.reason = reason
        rank_zero_warn(
            f"AttentionSwap kept {self.entry.name or type(self.module).__name__!r}'s own "
            f"attention ({self.entry.family}): {reason}."
        )


def _keep_saved_tensors() -> Any:
    """Saved-tensor hooks of our own, innermost: an enclosing checkpoint's do not see these."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _bind(
    forward: Callable[..., Any], ctx: SwapContext, inputs: tuple[tuple[Any, ...], dict[str, Any]]
) -> Callable[[], Any]:
    return lambda: forward(ctx, *inputs[0], **inputs[1])


def _tolerance(tensors: list[Tensor]) -> float:
    dtypes = [t.dtype for t in tensors if t.is_floating_point()]
    return max((DEFAULT_TOLERANCE.get(d, 1e-2) for d in dtypes), default=1e-4)


_HALF = (torch.float16, torch.bfloat16)


def _half(tensors: list[Tensor]) -> bool:
    return any(t.dtype in _HALF for t in tensors)


@contextlib.contextmanager
def _upcast(module: nn.Module) -> Iterator[None]:
    """Half-precision parameters and buffers in float32 inside; the same storage after."""
    saved = [(t, t.data) for t in (*module.parameters(), *module.buffers()) if t.dtype in _HALF]
    for tensor, data in saved:
        tensor.data = data.float()
    try:
        yield
    finally:
        for tensor, data in saved:
            tensor.data = data


def _copy_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], requires_grad: bool, upcast: bool = False
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Detached copies (aliasing kept: ``mha(x, x, x)`` stays self-attention).

    ``upcast``: half-precision tensors become float32 (the reference run).
    """
    memo: dict[int, Tensor] = {}

    def copy(value: Any) -> Any:
        if isinstance(value, Tensor):
            if id(value) not in memo:
                clone = value.detach().clone()
                if upcast and clone.dtype in _HALF:
                    clone = clone.float()
                if requires_grad and clone.is_floating_point():
                    # A non-leaf (a view of the leaf): hooks on module inputs, such
                    # as count_flops' module tracker, refuse leaves in autograd.grad.
                    clone = clone.requires_grad_(True).view_as(clone)
                memo[id(value)] = clone
            return memo[id(value)]
        if isinstance(value, (tuple, list)):
            return type(value)(copy(v) for v in value)
        if isinstance(value, dict):
            return {k: copy(v) for k, v in value.items()}
        return value

    return copy(args), copy(kwargs)


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class _Run:
    """One forward on the check's inputs, its gradients, and its timing."""

    def __init__(
        self,
        fn: Callable[[], Any],
        inputs: tuple[tuple[Any, ...], dict[str, Any]],
        module: nn.Module,
        grad: bool,
    ) -> None:
        self.fn = fn
        self.grad = grad
        output = fn()
        self.not_implemented = output is NotImplemented
        self.tensors = [] if self.not_implemented else _tensors(output)
        self.targets = [t for t in _tensors(inputs) if t.requires_grad]
        self.n_inputs = len(self.targets)
        self.targets += [p for p in module.parameters() if p.requires_grad]
        self.grads: list[Tensor | None] = []
        if grad and not self.not_implemented:
            self.grads = self._backward(self.tensors)

    def _projections(self, outputs: list[Tensor]) -> list[Tensor]:
        # A fixed random projection of each output: the same for both runs.
        generator = torch.Generator().manual_seed(1234)
        return [
            torch.randn(o.shape, generator=generator, dtype=torch.float32).to(o.device, o.dtype)
            for o in outputs
        ]

    def _backward(self, tensors: list[Tensor]) -> list[Tensor | None]:
        outputs = [t for t in tensors if t.requires_grad]
        if not outputs or not self.targets:
            return []
        return list(
            torch.autograd.grad(
                outputs, self.targets, self._projections(outputs), allow_unused=True
            )
        )

    def error(self, other: _Run) -> float:
        """Largest relative error of ``other``'s outputs and gradients against ours.

        Outputs and input gradients: each tensor's largest error, scaled by its
        own largest value, floored at 1% of the largest value in its group.

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
        outputs = _relative_errors(list(zip(self.tensors, other.tensors, strict=True)))
        inputs = _relative_errors(list(zip(self.grads[:n], other.grads[:n], strict=True)))
        params = _vector_error(list(zip(self.grads[n:], other.grads[n:], strict=True)))
        if outputs is None or inputs is None or params is None:
            return math.inf
        errors = [e for e in (outputs, inputs, params) if e.numel()]
        if not errors:
            return 0.0
        return float(torch.cat(errors).max())  # SYNC: once per module check

    def time(self, repeats: int = 3) -> float:
        """Median seconds of forward (+ backward), after one warm-up."""
        device = self.tensors[0].device if self.tensors else torch.device("cpu")
        times = []
        for i in range(repeats + 1):
            _synchronize(device)
            start = time.perf_counter()
            output = _tensors(self.fn())
            if self.grad:
                self._backward(output)
            _synchronize(device)
            if i:
                times.append(time.perf_counter() - start)
        return statistics.median(times)


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


def _relative_errors(pairs: list[tuple[Tensor | None, Tensor | None]]) -> Tensor | None:
    """Per-pair relative errors (see :meth:`_Run.error`); ``None`` for a shape mismatch."""
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


def _vector_error(pairs: list[tuple[Tensor | None, Tensor | None]]) -> Tensor | None:
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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # SYNC: timing a check, once per module


def swapped_modules(model: nn.Module) -> dict[str, _SwappedForward]:
    """The swaps live in ``model``, by module name."""
    swaps = {}
    for name, module in model.named_modules():
        forward = replaced_forward(module)
        if isinstance(forward, _SwappedForward):
            swaps[name] = forward
    return swaps


def _decision(entry: ModuleSwap) -> dict[str, Any]:
    """What was decided for a module, as plain values (checkpoints, collectives)."""
    return {
        "status": entry.status,
        "backend": entry.backend,
        "reason": entry.reason,
        "parity_error": entry.parity_error,
        "speedup": entry.speedup,
        "checked": entry.checked,
    }


def _differs(ours: Mapping[str, Any] | None, theirs: Mapping[str, Any] | None) -> bool:
    if ours is None or theirs is None:
        return ours is not theirs
    if ours["status"] != theirs["status"]:
        return True
    return bool(ours["status"] == "active" and ours["backend"] != theirs["backend"])


def _said(decision: Mapping[str, Any] | None) -> str:
    if decision is None:
        return "did not find it"
    if decision["status"] == "reverted":
        return f"reverted it ({decision['reason']})"
    if decision["status"] == "active":
        return f"picked {decision['backend']!r}"
    return "had not checked it yet"


def agree_across_ranks(report: SwapReport) -> None:
    """Make every rank run rank 0's decisions: each module's backend, or its revert.

    Each rank checks and times its swaps on its own inputs, so ranks can decide
    differently (a parity error near the tolerance, ``auto``'s timings). This
    gathers every rank's decisions in one ``all_gather_object`` (a collective:
    every rank calls it once, at the same point; AttentionSwap does after the
    first training batch), makes each rank apply rank 0's, and notes on rank 0,
    in the report's ``ranks`` column and one warning, what the other ranks had
    decided. Modules not checked yet on rank 0 are left to each rank. Without
    an initialised process group of two or more ranks it does nothing.

    Example::

        >>> from torch import nn
        >>> layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, batch_first=True)
        >>> report = swap_attention(layer, sample=torch.randn(2, 5, 16))
        >>> agree_across_ranks(report)  # one process: its decisions stand
        >>> report.modules[0].status, report.modules[0].ranks
        ('active', '')
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    mine = {entry.name: _decision(entry) for entry in report.modules}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # once per fit, not per step
    chosen: dict[str, dict[str, Any]] = everyone[0]
    if dist.get_rank() != 0:
        for name, decision in chosen.items():
            swap = report._swaps.get(name)
            if swap is not None and _differs(decision, mine.get(name)):
                swap.adopt(decision, "on rank 0", pin=True, trust=True)
        return
    notes = []
    entries = {entry.name: entry for entry in report.modules}
    for rank, theirs in enumerate(everyone[1:], start=1):
        for name in sorted(set(chosen) | set(theirs)):
            if not _differs(chosen.get(name), theirs.get(name)):
                continue
            note = f"rank {rank} {_said(theirs.get(name))}"
            entry = entries.get(name)
            if entry is not None:
                entry.ranks = "; ".join(filter(None, (entry.ranks, note)))
            notes.append(f"{name or '(root)'}: {note}")
    if notes:
        rank_zero_warn(
            "AttentionSwap: the ranks had decided differently; every rank now runs rank 0's "
            "decisions. " + "; ".join(notes) + "."
        )
