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
   output (see :meth:`._parity.Run.error` for the measure). In half precision both are
   measured against a float32 run of the module's own forward (the eager softmax
   in bf16 is itself far from exact): a backend passes within the tolerance or
   within twice the module's own error.
   A module whose error exceeds that is reverted, with a warning. The checked
   call returns the fused output when the check passes (equal within the
   tolerance; a recomputation under activation checkpointing then runs what the
   forward ran) and the module's own output otherwise. Without a sample, each module is
   also checked at swap time on a small synthetic input of its own (a Hugging Face model
   that fails it stays pending: its masks come from its real calls, which decide).
3. ``backend="auto"`` times the candidate backends on those real inputs, with
   backward, and keeps the fastest that passes: once per kind of call (module class
   and input shapes), so a model's like blocks share one backend and, compiled, one
   graph. Where the module's own forward was timed more than 10% faster than every
   passing backend, it keeps its own (reverted, with the ratio) for all but packed
   batches: only the swapped attention keeps their documents apart.
4. Under ``torch.distributed``, :func:`agree_across_ranks` makes every rank run
   rank 0's decisions (AttentionSwap calls it after the first training batch).

The report is live: entries fill in as modules are checked.

This module is the driver; the parts live apart: the report (:mod:`._swap_report`),
the forward put on each module and its check (:mod:`._swapped_forward`), the
check's measure (:mod:`._parity`), ``auto``'s timing (:mod:`._auto_timing`) and the
ranks' agreement (:mod:`._rank_agreement`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_speedkit import _validation
from lightning_speedkit._random import random_state_kept
from lightning_speedkit._surgery import refuse_wrapped, replace_forward, replaced_forward
from lightning_speedkit.attention._attention_pattern import Found
from lightning_speedkit.attention._discovery import Discovery, probed
from lightning_speedkit.attention._parity import DEFAULT_TOLERANCE, eval_mode, force_eager
from lightning_speedkit.attention._rank_agreement import agree
from lightning_speedkit.attention._swap_report import ModuleSwap, SwapReport
from lightning_speedkit.attention._swapped_forward import _SwappedForward  # pickles name it here
from lightning_speedkit.attention._traced import TracedAttention
from lightning_speedkit.attention.adapters import TRACED, AttentionAdapter, adapters
from lightning_speedkit.attention.backends import BackendChoice, check_backend
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = [
    "DEFAULT_TOLERANCE",
    "ModuleSwap",
    "SwapReport",
    "agree_across_ranks",
    "swap_attention",
    "swapped_modules",
]


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
            the candidates on the first real inputs, keep the fastest that passes, or
            the module's own forward where that was clearly faster).
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
            than at the model's first call. Blocks compiled in place
            (:class:`~lightning_speedkit.RegionalCompile`) run eagerly in that call, as
            in every check: they compile at the model's own first call, once.
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
    # The checks' synthetic inputs and timed calls draw no number of the user's run (its
    # loader's shuffle seed comes from the same global generator).
    with random_state_kept():
        swaps, excluded = _swap_modules(model, report, backend, tolerance, measure)
        discovery = _discover(model, report, excluded, backend, tolerance, measure)
        if not swaps and not report.skipped and discovery is None:
            _warn_nothing_found(type(model).__name__)
        if sample is not None:  # the kit's run, not the model's: compiled blocks run eagerly
            with eval_mode(model), torch.enable_grad(), force_eager():
                _call(model, sample)  # checks the swaps; probed modules' first call is traced
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
            swap = _SwappedForward(
                module, entry, adapter, binding, tolerance, measure, report._auto_picks
            )
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
        swap = _SwappedForward(
            found.owner, entry, TRACED, binding, self.tolerance, self.measure, report._auto_picks
        )
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


def swapped_modules(model: nn.Module) -> dict[str, _SwappedForward]:
    """The swaps live in ``model``, by module name."""
    swaps = {}
    for name, module in model.named_modules():
        forward = replaced_forward(module)
        if isinstance(forward, _SwappedForward):
            swaps[name] = forward
    return swaps


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
    rank, world_size = dist.get_rank(), dist.get_world_size()
    agree(report, rank=rank, world_size=world_size, all_gather=dist.all_gather_object)
