"""The forward ``swap_attention`` puts on a module: its own until checked, then fused.

A swapped module's first call on real inputs (and its first with gradients) runs
its own forward and the fused one on copies of those inputs and compares them
(:mod:`._parity`); ``auto`` also times the passing backends (:mod:`._auto_timing`).
A module whose fused forward fails is reverted to its own, with a warning. One whose
own forward ``auto`` timed clearly faster runs it too, but for packed batches: the fused
forward that passed its check still runs those, as only it keeps their documents apart.
A module that holds FSDP2 units (a Hugging Face model under ``fsdp2_zero2``) is checked
forward only, without gradients: see :func:`._parity.holds_fsdp2_unit`. The checks
run compiled blocks (``RegionalCompile``'s) eagerly, so they compile nothing, and
compare real tokens only where the call carries a padding mask (see :mod:`._parity`).
Decisions made elsewhere (rank 0's, a resumed run's) are taken with
:meth:`_SwappedForward.adopt`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_speedkit._random import random_state_kept
from lightning_speedkit._surgery import (
    note_first_call_work,
    original_forward,
    replace_forward,
    replaced_forward,
    restore_forward,
    side_run,
)
from lightning_speedkit.attention import _auto_timing, _documents, backends
from lightning_speedkit.attention._auto_timing import own_is_faster, pick_fastest
from lightning_speedkit.attention._input_copies import caller, copy_inputs
from lightning_speedkit.attention._own_calls import warn_own_attention
from lightning_speedkit.attention._parity import (
    Failure,
    Inputs,
    Run,
    eval_mode,
    force_eager,
    holds_fsdp2_unit,
    is_half,
    real_positions,
    revert_note,
    tensors,
    tolerance_for,
    upcast,
)
from lightning_speedkit.attention._swap_report import ModuleSwap
from lightning_speedkit.attention._traced import SwapRefusedError, swapped_call
from lightning_speedkit.attention.adapters import AttentionAdapter, SwapContext
from lightning_speedkit.attention.backends import BACKENDS, Attend, auto_candidates
from lightning_speedkit.measure.flops import not_counted

log = logging.getLogger(__name__)


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
        picks: dict[Hashable, tuple[str, float | None]] | None = None,
    ) -> None:
        self.module = module
        self.entry = entry
        self.adapter = adapter
        self.original = original_forward(module)
        self.tolerance = tolerance
        self.measure = measure
        self._attends: dict[str, Attend] = {}
        self._picks = {} if picks is None else picks  # auto's, shared by a swap's modules
        first = "sdpa" if entry.requested == "auto" else entry.requested
        self.ctx = SwapContext(module, self.original, self._attend(first), binding)
        self.checked_forward = False
        self.checked_backward = False
        self._pinned = False
        self.packed_only = False
        """``auto`` kept the own forward as faster: the fused one runs packed batches only."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.packed_only and _documents.active() is None:
            return self.original(*args, **kwargs)
        if torch.compiler.is_compiling():  # checks run eagerly; a traced call takes what passed
            if self.entry.status == "active" or self.packed_only:
                return self._fast(self.ctx, args, kwargs)
            return self.original(*args, **kwargs)
        grad = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        with swapped_call():  # an enclosing module's trace or fusion does not look in here
            if self.packed_only:
                return self._fast(self.ctx, args, kwargs)
            if not self.checked_forward or (grad and not self.checked_backward):
                return self._check_call(args, kwargs, grad)
            return self._fast(self.ctx, args, kwargs)

    def _fast(self, ctx: SwapContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = self.adapter.forward(ctx, *args, **kwargs)
        if out is NotImplemented:
            if _documents.active() is not None:
                warn_own_attention(self.entry.name or type(self.module).__name__)
            return self.original(*args, **kwargs)
        return out

    def _attend(self, backend: str) -> Attend:
        if backend not in self._attends:
            self._attends[backend] = Attend(backend)
        return self._attends[backend]

    # ------------------------------------------------------------------ checks

    def check_synthetic(self) -> None:
        """Check on the adapter's own small input, untimed: catches look-alikes early; a failure
        waits for the first real call where the example does not decide (`example_decides`)."""
        if self.adapter.example_inputs is None:
            return
        example = self.adapter.example_inputs(self.module)
        if example is None:
            return
        with (
            eval_mode(self.module),
            torch.enable_grad(),
            _documents.suspended(),
            force_eager(),
            backends.provisional_fallbacks(),
        ):  # where it is now, not where it trains
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
        # backward stays theirs (an enclosing activation checkpoint must not count it). A
        # packed batch's documents are left out: both forwards attend over whole rows.
        # Compiled blocks inside run eagerly: the check's eval mode, grad mode and copies
        # would each compile them anew (RegionalCompile compiles each block once).
        note_first_call_work()  # a step unlike later ones: SpeedMonitor counts another
        packed = _documents.active() is not None  # read before the check suspends them
        modes = [(m, m.training) for m in self.module.modules()]
        backward = grad and not holds_fsdp2_unit(self.module)
        with (
            torch.no_grad() if grad and not backward else contextlib.nullcontext(),
            eval_mode(self.module),
            not_counted(),
            _keep_saved_tensors(),
            _documents.suspended(),
            random_state_kept(),  # in the user's step: its dropout draws as without the check
            side_run(),  # a frozen-feature cache inside runs as it is, uncounted
            force_eager(),
        ):
            passed = self._check(
                args,
                kwargs,
                backward,
                time_it=True,  # auto always times its candidates; one backend only if measure
                label="forward+backward" if backward else "forward",
                training=modes if any(training for _, training in modes) else None,
                packed=packed,
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
        packed: bool = False,
    ) -> bool:
        """Compare fused against own on copies of these inputs; revert on failure.

        Compared in eval mode (no dropout, the same numbers both ways); ``training``, the
        modes of a module called in training, has each passing backend also run once
        in them, to drop one that cannot (the CPU's flash kernel has no dropout).
        ``auto`` reverts a module whose own forward was timed clearly faster than every
        passing backend, unless ``packed`` (a packed batch's documents were active at the
        call): only the swapped attention keeps them apart.

        Outputs are compared at the real tokens of a call that carries a padding mask
        (:func:`._parity.real_positions`). Returns whether a check happened and passed
        (the adapter may not handle these inputs: then nothing is decided).
        """
        entry = self.entry
        copies = copy_inputs(args, kwargs, requires_grad=grad)
        real = real_positions(self.original, self.module, args, kwargs)
        try:
            own = Run(caller(self.original, copies), copies, self.module, grad, real)
        except Exception:
            if label != "synthetic":
                raise  # the module's own forward fails on its real inputs: the user's error
            # Its forward wants other inputs than the adapter's example: check at first call.
            log.debug("no synthetic check for %s", entry.name, exc_info=True)
            return False
        if not own.tensors:
            return False
        # auto picks here (a pinned module runs the pick made elsewhere, as decided there)
        auto = entry.requested == "auto" and label != "synthetic" and not self._pinned
        if auto:
            candidates: Sequence[str] = auto_candidates(own.tensors[0].device)
        else:
            candidates = [self.ctx.attend.backend]
        tolerance = self.tolerance or tolerance_for(own.tensors)
        reference = self._reference(args, kwargs, own) if is_half(own.tensors) else None
        if reference is not None:  # judge both against float32, not fused against eager
            tolerance = max(tolerance, 2 * reference.error(own))
        judged = self._judge(candidates, copies, reference or own, tolerance, label, grad)
        if judged is None:
            return False
        passing, failures = judged
        device = own.tensors[0].device
        untrained: list[Failure] = []  # passed in eval mode, cannot run the training call
        if training is not None:
            runs = [(p, self._fails_in_training(p[0], copies, training)) for p in passing]
            passing = [p for p, why in runs if why is None]
            untrained = [Failure(p[0], None, why) for p, why in runs if why is not None]
        if not passing:  # one that passed in eval mode is the closest miss: reported
            chosen, note = revert_note(untrained + failures, next(iter(untrained), None))
            if label == "synthetic" and not getattr(self.adapter, "example_decides", True):
                log.debug("%s: %s; its first call decides", entry.name, note)
                return False  # pending: checked on its real inputs at its first call
            self._note_backend(chosen.backend, chosen.error, device)
            self._revert(note)
            return False
        if time_it and (len(passing) > 1 or self.measure or auto):  # own is auto's candidate
            backend, error_value, entry.speedup, timed = self._pick(own, passing, copies, grad)
            # Settled on a training call only (with gradients): a first call without them
            # (the validation sanity check) times no backward, and its batch may be
            # unpacked where the training batches are packed.
            if auto and grad and own_is_faster(entry.speedup) and not packed:
                self._note_backend(backend, None, device)  # it passed: slower, not wrong
                self._keep_own(backend, device, entry.speedup, warn=timed)
                return False
        else:
            backend, error_value, _ = passing[0]
        self.ctx = SwapContext(self.module, self.original, self._attend(backend), self.ctx.binding)
        self._note_backend(backend, error_value, device)
        entry.checked = label
        entry.status = "active"
        return True

    def _note_backend(self, backend: str, error: float | None, device: torch.device) -> None:
        """The report's backend and parity error: the backend judged, passing or not (the
        error ``None`` where a backend that passed is not kept: the note says why)."""
        if backend in BACKENDS:
            self.entry.backend = self._attend(backend).describe(device)
        self.entry.parity_error = error

    def _judge(
        self,
        candidates: Sequence[str],
        copies: Inputs,
        reference: Run,
        tolerance: float,
        label: str,
        grad: bool,
    ) -> tuple[list[tuple[str, float, Run]], list[Failure]] | None:
        """Each candidate's fused forward against ``reference``: those within ``tolerance``
        as ``(backend, error, run)``, and the others' failures; None when the adapter
        does not handle these inputs (nothing is decided)."""
        passing: list[tuple[str, float, Run]] = []
        failures: list[Failure] = []
        for backend in candidates:
            ctx = SwapContext(
                self.module, self.original, self._attend(backend), self.ctx.binding, checking=True
            )
            try:
                forward = _bind(self.adapter.forward, ctx, copies)
                fused = Run(forward, copies, self.module, grad, reference.real)
            except SwapRefusedError as error:
                failures.append(Failure(backend, None, str(error)))
                continue
            except Exception as error:
                why = f"the fused forward raised {type(error).__name__}: {error}"
                failures.append(Failure(backend, None, why))
                continue
            if fused.not_implemented:
                return None
            error_value = reference.error(fused)
            if error_value <= tolerance:
                passing.append((backend, error_value, fused))
            else:
                why = (
                    f"parity error {error_value:.2e} > tolerance {tolerance:.1e} "
                    f"on {label} inputs with backend {backend!r}"
                )
                failures.append(Failure(backend, error_value, why))
        return passing, failures

    def _pick(
        self, own: Run, passing: list[tuple[str, float, Run]], inputs: Inputs, grad: bool
    ) -> tuple[str, float, float | None, bool]:
        """The fastest passing backend, its error and speedup, and whether it was timed
        here (not taken from an earlier module of its kind); ``auto`` times once per kind.

        Modules of one class called on inputs of one shape (a model's blocks) do the same
        work: timing each anew would pick by noise, and blocks that differ only in their
        backend compile to one graph each (dynamo guards on the backend), which soon runs
        past dynamo's recompile limit and leaves the later blocks uncompiled. The kind's
        speedup goes with its pick, so its modules also keep or leave their own forward
        alike.
        """
        if self.entry.requested != "auto":
            return (*pick_fastest(own, passing), True)
        kind = _call_kind(self.module, self.entry, inputs, grad)
        known = self._picks.get(kind)
        for backend, error_value, _ in passing:
            if known is not None and backend == known[0]:
                return backend, error_value, known[1], False
        backend, error_value, speedup = pick_fastest(own, passing)
        self._picks[kind] = (backend, speedup)  # the later modules of its kind take it
        return backend, error_value, speedup, True

    def _keep_own(
        self, backend: str, device: torch.device, speedup: float | None, *, warn: bool
    ) -> None:
        """``auto``'s revert of a module whose own forward was timed clearly faster.

        Reported like a failed check (``reverted``, with the reason and the ratio); said
        once per kind of call: the later modules of its kind are reverted without a word.
        ``backend`` passed its check: it still runs packed batches.
        """
        self._revert(
            f"own forward faster: {backend!r}, the fastest passing backend, ran at "
            f"{speedup:.2f}x the own forward's speed (auto swaps from "
            f"{_auto_timing.OWN_FASTER_BELOW:.2f}x; name a backend to swap it anyway)",
            warn=warn,
            more="; the modules of its kind called later keep theirs too",
            packed=self._attend(backend).describe(device),
        )

    def _fails_in_training(
        self,
        backend: str,
        inputs: Inputs,
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
        cuda = sorted({t.device.index or 0 for t in tensors(inputs) if t.device.type == "cuda"})
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

    def _reference(self, args: tuple[Any, ...], kwargs: dict[str, Any], own: Run) -> Run | None:
        """``own`` run again in float32: inputs, parameters and buffers upcast."""
        grad, real = own.grad, own.real
        copies = copy_inputs(args, kwargs, requires_grad=grad, upcast=True)
        device = next((t.device for t in tensors(copies)), torch.device("cpu"))
        try:
            with upcast(self.module), torch.autocast(device.type, enabled=False):
                return Run(caller(self.original, copies), copies, self.module, grad, real)
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
        """Take a decision made elsewhere as this module's (see :func:`._rank_agreement.decision`).

        Args:
            decision: what was decided: reverted (and why), or active with a backend.
            source: where it was decided, for the report ("on rank 0", ...).
            pin: run the decided backend (``auto``'s pick) rather than timing again.
            trust: take its checks as done here (the ranks agree); else check again.
        """
        entry = self.entry
        status = decision.get("status")
        packed = decision.get("packed_backend")
        if status == "reverted":
            if entry.status != "reverted" or entry.packed_backend != packed:
                self._revert(f"reverted {source}: {decision.get('reason', '')}", packed=packed)
            return
        if status != "active":
            return
        if replaced_forward(self.module) is not self:  # reverted here: swapped again
            replace_forward(self.module, self)
        self.packed_only = False
        entry.packed_backend = None
        backend = _backend_name(decision.get("backend"))
        if pin and backend in BACKENDS:
            self.pin(backend)
        entry.status = "active"
        entry.reason = ""
        if trust:
            checked = str(decision.get("checked", ""))
            self.checked_forward = checked in ("forward", "forward+backward")
            self.checked_backward = checked == "forward+backward" or (
                checked == "forward" and holds_fsdp2_unit(self.module)  # all it can check
            )
            entry.checked = checked
            entry.backend = decision.get("backend")
            entry.parity_error = decision.get("parity_error")
            entry.speedup = decision.get("speedup")

    def _revert(
        self, reason: str, *, warn: bool = True, more: str = "", packed: str | None = None
    ) -> None:
        """Give the module its own forward back; for all but packed batches where
        ``packed`` (a backend that passed its check, as :meth:`Attend.describe` says it)."""
        backend = _backend_name(packed)
        if backend in BACKENDS:
            if replaced_forward(self.module) is not self:  # reverted here: for packed batches
                replace_forward(self.module, self)
            self.packed_only = True
            self.ctx = SwapContext(
                self.module, self.original, self._attend(backend), self.ctx.binding
            )
            more += f"; packed batches still run {backend!r}, which keeps their documents apart"
        else:
            restore_forward(self.module, self)
            self.packed_only = False
        self.entry.status = "reverted"
        self.entry.reason = reason
        self.entry.packed_backend = packed if backend in BACKENDS else None
        if warn:
            rank_zero_warn(
                f"AttentionSwap kept {self.entry.name or type(self.module).__name__!r}'s own "
                f"attention ({self.entry.family}): {reason}{more}."
            )


def _backend_name(described: Any) -> str:
    """The backend an :meth:`Attend.describe` names: ``"sdpa (math fallback)"`` ran sdpa."""
    return str(described or "").split(" ", 1)[0]


def _call_kind(module: nn.Module, entry: ModuleSwap, inputs: Inputs, grad: bool) -> Hashable:
    """What makes two modules' calls the same work: class, family, input shapes and dtypes."""
    shapes = tuple((tuple(t.shape), t.dtype, t.device) for t in tensors(inputs))
    cls = type(module)
    return (cls.__module__, cls.__qualname__, entry.family, entry.detail, grad, shapes)


def _keep_saved_tensors() -> Any:
    """Saved-tensor hooks of our own, innermost: an enclosing checkpoint's do not see these."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def _bind(forward: Callable[..., Any], ctx: SwapContext, inputs: Inputs) -> Callable[[], Any]:
    """``forward(ctx, *args, **kwargs)`` on the check's inputs, a cache copied per call."""
    return caller(lambda *args, **kwargs: forward(ctx, *args, **kwargs), inputs)
