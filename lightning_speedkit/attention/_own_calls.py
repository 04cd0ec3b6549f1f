"""What a model computes itself on a packed batch: its own SDPA calls, the positions it builds.

Three global module hooks, registered at the first packed batch and kept, watch every
module call while a packed batch's documents are active (:mod:`._documents`):

* the outermost call runs under a torch-function mode in which any
  ``F.scaled_dot_product_attention`` call over the packed rows runs per document, the
  model's own included (a custom Llama- or nanoGPT-style attention that calls SDPA
  itself, which no family swaps: it is fused already). Rotary positions need nothing
  more: they enter attention only as the difference between a query's and a key's
  position, the same within a document wherever it sits in its row, so the tables a model
  builds from its own ``torch.arange(T)`` or slices from a precomputed buffer give each
  document what it gets alone (up to the rounding of the angles at the row's offsets);
* an ``nn.Embedding`` fed ``torch.arange(S)`` over the packed rows (nanoGPT's learned
  positions; BERT's and GPT-2's called without ``position_ids``, one row or several)
  gets each document's positions instead, and one fed a count over each whole row from an
  offset (RoBERTa's from ``padding_idx + 1``) gets each document's count from it;
* absolute positions added from a table of the packed length with no row axis (a
  sinusoidal ``pe[:T]``, a learned ``pos_embed[:, :T]``) cannot be cut generally: they
  run on from one document into the next, said once with the fix;
* a softmax over ``(S, S)`` of the packed rows is attention no one cut (a module the swap
  skipped or reverted, written out): :func:`packed_documents` says so once, naming it.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_speedkit.attention import _documents
from lightning_speedkit.attention._mixing_advice import mixing_message
from lightning_speedkit.measure._packed_check import may_attend, warn_if_state_carried

__all__ = [
    "calls_sdpa",
    "compiled_outside_modules",
    "model_hooks",
    "own_sdpa_modules",
    "own_sdpa_outside_swap",
    "remove_model_hooks",
    "warn_compiled_outside",
    "warn_if_mixed",
    "warn_mixing",
    "warn_own_attention",
]

_HOOKS: list[Any] = []  # the global hooks' handles, once registered
_LOCAL = threading.local()  # per thread: the module calls open now, and the mode of the outermost
#: Modules whose own SDPA calls ran per document since the last :func:`own_sdpa_modules`.
_OWN_SDPA: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_ADDS = {torch.add, Tensor.add, Tensor.__add__, Tensor.__radd__, Tensor.__iadd__, Tensor.add_}
_SOFTMAXES = {torch.softmax, F.softmax, Tensor.softmax}
#: Whether the mode of an eager outermost module call is open now (read while tracing).
_MODE_OPEN = [False]
#: Set by a module call on a packed batch that torch.compile traced with no eager module
#: call around it (a compiled ``training_step``): its SDPA calls ran without the mode.
_COMPILED_OUTSIDE = [False]


def model_hooks() -> None:
    """Have the model's own calls keep the active documents apart (see above).

    The hooks are registered at the first packed batch and stay, doing nothing while no
    documents are active: ``torch.compile`` guards on the global hooks' ids, and hooks
    registered anew for each batch would recompile every compiled block at every batch.
    """
    if _HOOKS:
        return
    # torch types a pre-hook as returning None; its returned args replace the call's.
    restart: Callable[..., Any] = _restart_positions
    register = nn.modules.module
    _HOOKS.extend(
        (
            register.register_module_forward_pre_hook(restart),
            register.register_module_forward_pre_hook(_enter_call),
            register.register_module_forward_hook(_exit_call, always_call=True),
        )
    )


def remove_model_hooks() -> None:
    """Take the global hooks away again; AttentionSwap does when its fit ends.

    Kept, they would sit in every later module call of the process, and a compiled
    model's guards see them: a RegionalCompile fit after a packed one, with SpeedMonitor
    adding and removing its own global hooks for its FLOP count, compiled 6 graphs where
    it compiles 2 without them.
    """
    while _HOOKS:
        _HOOKS.pop().remove()


def own_sdpa_modules() -> set[nn.Module]:
    """The modules whose own SDPA calls ran per document since the last call; cleared.

    Seen in eager calls only (a compiled block keeps no books): see :func:`calls_sdpa`.
    """
    modules = set(_OWN_SDPA)
    _OWN_SDPA.clear()
    return modules


def calls_sdpa(module: nn.Module) -> bool:
    """Whether the module's ``forward`` calls ``scaled_dot_product_attention`` by name, or
    under a name its module gave it (``from torch.nn.functional import
    scaled_dot_product_attention as sdpa``), or hands its work to a ``processor`` that
    does (diffusers' ``Attention``, whose default ``AttnProcessor2_0`` calls SDPA).

    Taken at its word: a forward that calls SDPA on one branch only (nanoGPT's
    ``if self.flash``) counts as calling it.
    """
    forward = type(module).forward
    if _names_sdpa(forward):
        return True
    code = getattr(forward, "__code__", None)
    if code is None or "processor" not in code.co_names:
        return False
    processor = vars(module).get("processor", dict(module.named_children()).get("processor"))
    if processor is None:
        return False
    kind = type(processor)  # a module processor (diffusers' IP-Adapter's): its forward too
    call, forward = (inspect.getattr_static(kind, name, None) for name in ("__call__", "forward"))
    return _names_sdpa(call) or _names_sdpa(forward)


def _names_sdpa(function: Any) -> bool:
    code = getattr(function, "__code__", None)
    if code is None:
        return False
    names = getattr(function, "__globals__", {})
    return "scaled_dot_product_attention" in code.co_names or any(
        names.get(name) is F.scaled_dot_product_attention for name in code.co_names
    )


def compiled_outside_modules() -> bool:
    """Whether, since the last call, a packed batch reached module calls that torch.compile
    traced from outside any module call (Lightning's ``trainer.fit(torch.compile(task))``
    compiles ``training_step``): the SDPA calls the model makes itself did not run per
    document there. Cleared."""
    seen, _COMPILED_OUTSIDE[0] = _COMPILED_OUTSIDE[0], False
    return seen


def own_sdpa_outside_swap(report: Any, model: nn.Module) -> list[str]:
    """The modules of ``model`` whose forward calls SDPA itself (:func:`calls_sdpa`) and
    still runs: none the swap replaced (``report.swapped``), nor a module inside one."""
    swapped = [] if report is None else report.swapped
    return [
        name or type(module).__name__
        for name, module in model.named_modules()
        if calls_sdpa(module) and not any(name == s or name.startswith(f"{s}.") for s in swapped)
    ]


def warn_compiled_outside(report: Any, model: nn.Module) -> None:
    """Say that :func:`compiled_outside_modules` saw a packed batch, naming the modules of
    ``model`` whose own SDPA calls attended across its documents; silent when there are
    none (the swapped attention's calls are graph breaks that ran per document)."""
    names = own_sdpa_outside_swap(report, model)
    if not names:
        return
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    shown = ", ".join(map(repr, names[:4])) + more
    rank_zero_warn(
        "A packed batch ran through a model that torch.compile traced from outside any "
        "module call (`trainer.fit(torch.compile(task))`, a compiled `training_step`): the "
        f"SDPA calls that {shown} {'makes itself' if len(names) == 1 else 'make themselves'} "
        "(the swap does not replace them) attend across the documents of a row there. "
        "Compile the model instead (`self.model = torch.compile(self.model)`) or its blocks "
        "(`RegionalCompile`)."
    )


def warn_mixing(report: Any, model: nn.Module | None) -> None:
    """Say which attention modules ran their own forward (reverted, skipped, or none found)
    on a packed step without calling SDPA on the packed rows: those mixed its documents."""
    kept_apart = own_sdpa_modules()
    named = dict(model.named_modules()) if model is not None else {}
    mixing = [
        name
        for name, _ in (*report.reverted, *report.skipped)
        if not (name in named and (named[name] in kept_apart or calls_sdpa(named[name])))
    ]
    if model is not None:
        warn_if_state_carried(model)  # recurrent layers and token convolutions: no swap helps
    if (
        report.modules or kept_apart or (model is not None and not may_attend(model))
    ) and not mixing:
        return
    rank_zero_warn(mixing_message(mixing, named))  # with the fix for each case


def warn_own_attention(name: str) -> None:
    """A swapped module ran its own attention on a packed batch: say so once."""
    _documents.warn_once(
        f"A packed batch reached {name!r}'s own attention (a call the swap does not handle), "
        "which attends across the documents of a row. Call it as the swap handles it (no "
        "extra mask, no attention weights asked for), or do not pack."
    )


def warn_if_mixed(documents: _documents.Documents) -> None:
    """Say once that attention the kit did not swap ran over a packed batch's whole rows."""
    mixed = documents.seen.get("mixed")
    if mixed is None:
        return
    _documents.warn_once(
        f"A packed batch reached attention in {mixed!r} that the kit did not swap: a softmax "
        "over whole packed rows, so every token there attended across the documents of its "
        "row, unless the module's own mask keeps them apart (transformers' eager "
        "attention does, on one row without an `attention_mask`). Swap it before the `with` "
        "(`swap_attention`; its report's `skipped` and `reverted` say why a module was left "
        "as it is, and `register_adapter` teaches the kit a family), or do not pack."
    )


def _note_whole_row_softmax(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> None:
    """A softmax over ``(S, S)`` of the packed rows is attention nobody cut: noted."""
    if torch.compiler.is_compiling():
        return
    documents = _documents.active()
    x = args[0] if args else (kwargs or {}).get("input")
    if documents is None or not isinstance(x, Tensor) or x.ndim < 3 or "mixed" in documents.seen:
        return
    n = documents.length
    if x.shape[-2:] != (n, n) or x.shape[0] % documents.rows:
        return
    if all(len(spans) == 1 for spans in documents.spans):
        return  # one span a row: no boundary to cross
    calls = _calls()
    documents.seen["mixed"] = type(calls[-1]).__name__ if calls else "the model"


def _calls() -> list[nn.Module]:
    calls: list[nn.Module] | None = getattr(_LOCAL, "calls", None)
    if calls is None:
        calls = _LOCAL.calls = []
    return calls


def _enter_call(module: nn.Module, args: tuple[Any, ...]) -> None:
    if torch.compiler.is_compiling():
        # Traced: no mode can be entered here. Compiling the model (an eager call of the
        # compiled module opens the mode first) or its blocks traces under the open mode;
        # a compiled function that calls the model does not. The flag is only stored (no
        # guard on it); the graph stores it again at each run.
        if not _MODE_OPEN[0] and _documents.active() is not None:
            _COMPILED_OUTSIDE[0] = True
        return
    calls = _calls()
    if not calls:
        if _documents.active() is None:
            return
        _LOCAL.mode = _OwnCalls()
        _LOCAL.mode.__enter__()
        _MODE_OPEN[0] = True
    calls.append(module)


def _exit_call(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
    if torch.compiler.is_compiling():
        return
    calls = _calls()
    if not calls:
        return
    calls.pop()
    if not calls:
        mode, _LOCAL.mode = _LOCAL.mode, None
        _MODE_OPEN[0] = False
        mode.__exit__(None, None, None)


_SDPA_SIGNATURE = inspect.Signature(
    [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
        for name, default in (
            ("query", inspect.Parameter.empty),
            ("key", inspect.Parameter.empty),
            ("value", inspect.Parameter.empty),
            ("attn_mask", None),
            ("dropout_p", 0.0),
            ("is_causal", False),
            ("scale", None),
            ("enable_gqa", False),
        )
    ]
)


class _SdpaPerDocument(TorchFunctionMode):
    """SDPA calls on the packed rows run per document (the kit's and the model's own)."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        documents = _documents.active()
        if (
            func is not F.scaled_dot_product_attention
            or documents is None
            or _documents._CUTTING[0]
        ):
            # A torch function that calls SDPA inside runs with this mode popped, so its SDPA
            # call is not seen here: ``nn.MultiheadAttention`` is cut per document before.
            return func(*args, **kwargs)
        return _sdpa_call(func, documents, args, kwargs)


@_documents.not_compiled
def _sdpa_call(
    func: Any, documents: _documents.Documents, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor:
    bound = _SDPA_SIGNATURE.bind(*args, **kwargs).arguments
    q, k, v = bound.pop("query"), bound.pop("key"), bound.pop("value")
    if not documents.covers(q, k, bool(bound.get("is_causal", False))):
        return func(q, k, v, **bound)
    mask = bound.pop("attn_mask", None)
    return _documents.per_document(func, documents, q, k, v, attn_mask=mask, **bound)


class _OwnCalls(_SdpaPerDocument):
    """SDPA on the packed rows per document, and absolute position tables named."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # Inside a compiled block no bookkeeping is kept (nothing for dynamo to guard on),
        # and that is asked only of the three kinds of call kept: with
        # `torch.compiler.is_compiling()` asked here for every call, torch 2.13 compiled
        # this method as a frame of its own when it ran eagerly under a model compiled
        # whole (a frame dynamo gave up on), and that frame served one attribute read's
        # value for another (`idx.device` came back as `idx.shape`).
        if func is F.scaled_dot_product_attention:
            _note_own_sdpa()
        elif func in _ADDS and len(args) == 2:
            _name_position_table(*args)
        elif func in _SOFTMAXES:
            _note_whole_row_softmax(args, kwargs)
        return super().__torch_function__(func, types, args, kwargs)


def _note_own_sdpa() -> None:
    """The module whose own SDPA call this is ran it per document: noted."""
    if torch.compiler.is_compiling():
        return
    calls = _calls()
    if calls:
        _OWN_SDPA.add(calls[-1])


def _name_position_table(a: Any, b: Any) -> None:
    """Warn once about a table of the packed length added over the rows (positions)."""
    if torch.compiler.is_compiling():
        return  # first: reading the documents while traced would guard on them
    documents = _documents.active()
    if documents is None or not isinstance(a, Tensor) or not isinstance(b, Tensor):
        return
    for x, table in ((a, b), (b, a)):
        if x.ndim != 3 or not table.is_floating_point() or table.shape[-1] != x.shape[-1]:
            continue
        n, rows = documents.length, documents.rows
        batch_first = x.shape[:2] == (rows, n) and (
            (table.ndim == 2 and table.shape[0] == n)
            or (table.ndim == 3 and table.shape[:2] == (1, n) and rows > 1)
        )
        seq_first = x.shape[:2] == (n, rows) and rows > 1 and table.shape[:-1] in ((n, 1), (n,))
        if batch_first or seq_first:
            _documents.warn_once(
                f"A table of {n} positions with no row axis (shape {tuple(table.shape)}) was "
                f"added to the packed rows {tuple(x.shape)}: absolute positions the model "
                "builds itself (a sinusoidal `pe[:T]`, a learned `pos_embed[:, :T]`) run on "
                "from one document into the next. Give the model's forward a `position_ids` "
                "argument and index its table with the batch's `position_ids` "
                "(`pe[position_ids]`), or do not pack."
            )
            return


def _from_zero(ids: Tensor, positions: Tensor) -> Tensor:
    """Whether ``ids`` are the batch's positions, each document's from 0 (PackingCollate's;
    its padding's all 0): a 0-d bool on the device, read with the caller's other values."""
    return ((ids == positions) | (ids == 0)).all() & (ids > 0).any()


def _name_positions_from_zero(pad: int) -> None:
    """Warn once that a position table whose padding row is ``pad`` got the batch's
    positions from 0: RoBERTa's count from ``padding_idx + 1``, so position ``pad`` would
    be read as padding and every other one is off by ``pad + 1``."""
    _documents.warn_once(
        f"A table with padding row {pad} (RoBERTa's and XLM-R's positions count from "
        f"padding_idx + 1 = {pad + 1}) got the batch's `position_ids`, which count from "
        f"0: every position is off by {pad + 1}. Do not pass `position_ids` to this "
        f"model (it builds its own, restarted per document while the batch is packed), "
        f"or pass `position_ids + {pad + 1}`."
    )


def _restart_positions(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """An ``nn.Embedding`` fed ``torch.arange(S)`` over the packed rows (nanoGPT's
    ``wpe(torch.arange(t))``, BERT's and GPT-2's ``(1, S)`` positions when called without
    ``position_ids``) gets each document's positions instead, ``(rows, S)``.

    On a batch of one row, a ``(1, S)`` input is also what the row's tokens look like: it
    is taken as positions when it is exactly ``0, 1, ..., S - 1`` and the row holds more
    than one document (the batch's own ``position_ids`` restart, so they never are).
    """
    documents = _documents.active()
    if documents is None or not isinstance(module, nn.Embedding) or not args:
        return None
    ids = args[0]
    if not isinstance(ids, Tensor) or ids.dtype not in (torch.int64, torch.int32):
        return None
    one_row_packed = documents.rows == 1 and len(documents.spans[0]) > 1
    whole_row = ids.ndim == 1 or (
        ids.ndim == 2 and ids.shape[0] == 1 and (documents.rows > 1 or one_row_packed)
    )
    # Traced (a model compiled whole): no reads of a row's values. Under dynamo's handling
    # of the hook a tensor's attributes can come back as other objects (``shape`` a dtype).
    compiling = torch.compiler.is_compiling() or not isinstance(ids.shape, torch.Size)
    if (compiling and not whole_row) or ids.shape[-1] != documents.length:
        return None
    arange = torch.arange(documents.length, device=ids.device, dtype=ids.dtype)
    if whole_row and torch.equal(ids.reshape(-1), arange):  # SYNC: only for a row-long input
        return (documents.positions(ids.device).to(ids.dtype), *args[1:])
    if compiling:
        return None
    restarted = _restart_run_on(ids, documents, arange, module.padding_idx)
    return None if restarted is None else (restarted, *args[1:])


@_documents.not_compiled  # eager only; run eagerly under a compiled model, dynamo would
# otherwise compile it as a frame of its own, guarded on the batch's documents (a recompile
# for every new layout)
def _restart_run_on(
    ids: Tensor, documents: _documents.Documents, arange: Tensor, padding_idx: int | None
) -> Tensor | None:
    """``(rows, S)`` positions a model counted over its whole rows from an offset
    (RoBERTa's and XLM-R's ``padding_idx + 1 + cumsum`` of the non-padding tokens): each
    document's restarted from the same offset, the row's trailing padding left as it is.

    Taken as positions only when every row counts on, one by one, from one offset
    (the same in every row) over all its spans but a last one that holds no count at all
    (padding): token ids never do.
    """
    if ids.ndim != 2 or ids.shape[0] != documents.rows:
        return None
    if all(len(spans) == 1 for spans in documents.spans):
        return None  # no boundary to count across
    positions = documents.positions(ids.device).to(ids.dtype)
    offset = ids[:, :1]
    counts_on = ids == offset + arange
    lead = counts_on.int().cumprod(dim=1).sum(dim=1)
    read = [lead, offset[:, 0].to(lead.dtype)]
    pad = padding_idx if padding_idx is not None and padding_idx < documents.length else None
    if pad is not None:  # a RoBERTa-style table: were its positions counted from 0? (same read)
        read.append(_from_zero(ids, positions).to(lead.dtype).expand_as(lead))
    # SYNC: one read per packed row-shaped embedding input (a token table's too: rejected here)
    leads, offsets, *zero = torch.stack(read).tolist()
    if pad is not None and zero[0][0]:
        _name_positions_from_zero(pad)
    if len(set(offsets)) != 1:
        return None
    for n, spans in zip(leads, documents.spans, strict=True):
        if n not in (documents.length, spans[-1][0]) or n == 0:
            return None
    return torch.where(arange < lead[:, None], offset + positions, ids)
