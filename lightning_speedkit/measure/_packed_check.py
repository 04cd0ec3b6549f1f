"""Whether a packed batch's documents are kept apart in a fit: said once when they are not.

A packed row holds several documents (``cu_seqlens``/``document_ids``, or transformers'
``cu_seq_lens_q``/``seq_idx``). Only attention the kit swapped keeps them apart: with
AttentionSwap, or ``swap_attention`` and each step inside ``packed_documents``. Without
either, every token attends across the documents of its row, and nothing said so: the
loss, and the throughput SpeedMonitor logs, are not those of the documents trained apart.

The check runs once per fit, at the end of the first packed batch (a module only a trace
finds is swapped during that batch's forward), and reads no tensor: the Trainer's
callbacks and the model's modules, each looked at once. A model with nothing that looks
like attention (:func:`may_attend`: an MLP token model) mixes nothing through attention,
and is not warned about that; recurrent layers and token convolutions mix documents
without attention, and are said once per model (:func:`warn_if_state_carried`). A
swapped module is marked where the kit's module surgery puts it
(:func:`lightning_speedkit._surgery.replaced_forward`: the kit's forward that replaces a
module's computation, which only an attention swap installs; activation checkpointing
wraps, it does not replace). AttentionSwap is found
among the callbacks without importing it here (measure does not import attention, which
imports measure): a callback of that class exists only once its module has been imported.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from types import CodeType
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_speedkit import _surgery
from lightning_speedkit.measure._batch_info import BatchInfo

__all__ = [
    "MIXED_DOCUMENTS",
    "PackedCheck",
    "VarlenWatch",
    "documents_kept_apart",
    "may_attend",
    "state_carriers",
    "warn_if_documents_mix",
    "warn_if_state_carried",
]

MIXED_DOCUMENTS = (
    "SpeedMonitor: the training batches are packed (`cu_seqlens`/`document_ids`) but no "
    "attention was swapped to keep their documents apart, so every token attends across "
    "the documents of its row (the loss and the throughput are not those of the documents "
    "trained apart). Add `AttentionSwap()` to the Trainer's callbacks, or call "
    "`swap_attention(model)` and run each step inside `packed_documents(batch)`."
)
_ATTENTION_SWAP = "lightning_speedkit.attention.attention_swap"
_TOLD_CARRIED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # the models said of, once each


#: Names whose call in a module's ``forward`` (or a function defined in it) computes or
#: dispatches attention: SDPA, a written-out softmax, FlexAttention, flash-attn's kernels,
#: transformers' attention interface and its eager function.
_ATTENDING_NAMES = frozenset(
    {
        "scaled_dot_product_attention",
        "softmax",
        "flex_attention",
        "flash_attn_func",
        "flash_attn_varlen_func",
        "flash_attn_qkvpacked_func",
        "attention_interface",
        "eager_attention_forward",
        "multi_head_attention_forward",
    }
)


def may_attend(model: nn.Module) -> bool:
    """Whether ``model`` may compute attention, read off its modules' classes and code:
    an ``nn.MultiheadAttention``, a class named for attention (``attn``, ``attention``,
    ``transformer``), or a ``forward`` that names an attention call (:data:`_ATTENDING_NAMES`).

    Generous on purpose: a false yes costs a warning, a false no a silent mix. A model
    that attends only through a helper function of its own, called from a module that
    names none of these, is missed.
    """
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention):
            return True
        name = type(module).__name__.lower()
        if any(word in name for word in ("attn", "attention", "transformer")):
            return True
        code = getattr(getattr(type(module), "forward", None), "__code__", None)
        if code is not None and _ATTENDING_NAMES & _names(code):
            return True
    return False


def state_carriers(model: nn.Module) -> list[str]:
    """The modules of ``model`` that carry state along a row of tokens, which no attention
    swap keeps apart: recurrent layers and cells, and 1-D convolutions wider than a token."""
    return [
        name or type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, (nn.RNNBase, nn.RNNCellBase))
        or (isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1)
    ]


def warn_if_state_carried(model: nn.Module) -> None:
    """Say once per model, on its first packed batch, which of its modules carry state from
    each document of a packed row into the next (:func:`state_carriers`)."""
    names = [] if model in _TOLD_CARRIED else state_carriers(model)
    if not names:
        return
    _TOLD_CARRIED.add(model)
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    rank_zero_warn(
        f"A packed batch (`cu_seqlens`/`document_ids`) reached "
        f"{', '.join(map(repr, names[:4]))}{more}: a recurrent layer or a 1-D convolution "
        f"carries state along the row, from each document into the next, and no attention "
        f"swap keeps the documents apart there (the loss is not the documents' own). Pad "
        f"instead of packing (`LengthBucketBatchSampler` keeps the padding small), or run "
        f"those modules per document (the batch's `cu_seqlens` says where each starts); a "
        f"module that does so already can ignore this."
    )


def _names(code: CodeType) -> set[str]:
    """The global and attribute names a function's code (and the code nested in it) uses."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, CodeType):
            names |= _names(constant)
    return names


def documents_kept_apart(
    callbacks: Iterable[L.Callback], model: nn.Module, varlen_taken: bool = False
) -> bool:
    """Whether attention in ``model`` takes a packed batch's documents: AttentionSwap among
    ``callbacks`` (it also says itself what it could not swap), a module of ``model``
    swapped by ``swap_attention``, or (``varlen_taken``) a transformers model set to flash
    attention was called with the batch's ``cu_seq_lens_q``: its variable-length kernel
    keeps them apart itself (:class:`VarlenWatch`)."""
    module = sys.modules.get(_ATTENTION_SWAP)  # never imported here: see the module docstring
    swap = getattr(module, "AttentionSwap", None)
    if swap is not None and any(isinstance(callback, swap) for callback in callbacks):
        return True
    return varlen_taken or any(_surgery.replaced_forward(m) is not None for m in model.modules())


class VarlenWatch:
    """Whether, in one step, a transformers model set to flash attention is called with
    ``cu_seq_lens_q``: the training step may drop the field, or the flash model may be
    another than the one the packed tokens go through (a vision tower on flash, the
    language model on ``sdpa``). Hooks on those models only, removed by :meth:`close`."""

    def __init__(self, model: nn.Module) -> None:
        self.taken = False
        flash = [m for m in model.modules() if _flash_attention(m)]
        self._handles = [m.register_forward_pre_hook(self._call, with_kwargs=True)
                         for m in flash]  # fmt: skip

    @classmethod
    def start(cls, info: BatchInfo | None, model: nn.Module) -> VarlenWatch | None:
        """A watch for the fit's first packed batch (``info.first_packed``); None for any
        other (the check runs once)."""
        return cls(model) if info is not None and info.first_packed else None

    def _call(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        self.taken = self.taken or kwargs.get("cu_seq_lens_q") is not None

    def close(self) -> bool:
        """Remove the hooks; whether a flash model was called with ``cu_seq_lens_q``."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return self.taken


def _flash_attention(module: nn.Module) -> bool:
    """A transformers model whose config runs flash attention (``flash_attention_2``,
    ``flash_attention_3``, a hub kernel of flash-attn): it takes ``cu_seq_lens_q``."""
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return isinstance(implementation, str) and "flash" in implementation


def warn_if_documents_mix(
    info: BatchInfo | None, trainer: L.Trainer, model: L.LightningModule, varlen_taken: bool
) -> None:
    """At the end of the fit's first packed batch (``info.first_packed``), warn (rank 0)
    when nothing keeps its documents apart; every other batch returns at once.
    ``varlen_taken``: what that step's :class:`VarlenWatch` saw."""
    if info is None or not info.first_packed:
        return
    warn_if_state_carried(model)
    callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    if not documents_kept_apart(callbacks, model, varlen_taken) and may_attend(model):
        rank_zero_warn(MIXED_DOCUMENTS)


class PackedCheck:
    """SpeedMonitor's check, once per fit, that its first packed batch's documents are
    kept apart: :meth:`start` and :meth:`end` around each training batch."""

    def __init__(self) -> None:
        self._varlen: VarlenWatch | None = None

    def start(self, info: BatchInfo | None, model: nn.Module) -> None:
        self.close()  # a batch that never ended (a failed step)
        self._varlen = VarlenWatch.start(info, model)

    def end(self, info: BatchInfo | None, trainer: L.Trainer, model: L.LightningModule) -> None:
        warn_if_documents_mix(info, trainer, model, self.close())

    def close(self) -> bool:
        """Remove a watch's hooks, if one is on; whether it saw ``cu_seq_lens_q`` taken."""
        varlen, self._varlen = self._varlen, None
        return varlen.close() if varlen is not None else False
