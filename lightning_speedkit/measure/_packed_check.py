"""Whether a packed batch's documents are kept apart in a fit: said once when they are not.

A packed row holds several documents (``cu_seqlens``/``document_ids``, or transformers'
``cu_seq_lens_q``/``seq_idx``). Only attention the kit swapped keeps them apart: with
AttentionSwap, or ``swap_attention`` and each step inside ``packed_documents``. Without
either, every token attends across the documents of its row, and nothing said so: the
loss, and the throughput SpeedMonitor logs, are not those of the documents trained apart.

The check runs once per fit, at the end of the first packed batch (a module only a trace
finds is swapped during that batch's forward), and reads no tensor: the Trainer's
callbacks and the model's modules, each looked at once. A swapped module is marked where
the kit's module surgery puts it (:func:`lightning_speedkit._surgery.replaced_forward`:
the kit's forward that replaces a module's computation, which only an attention swap
installs; activation checkpointing wraps, it does not replace). AttentionSwap is found
among the callbacks without importing it here (measure does not import attention, which
imports measure): a callback of that class exists only once its module has been imported.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_speedkit import _surgery
from lightning_speedkit.measure._batch_info import BatchInfo

__all__ = ["MIXED_DOCUMENTS", "documents_kept_apart", "warn_if_documents_mix"]

MIXED_DOCUMENTS = (
    "SpeedMonitor: the training batches are packed (`cu_seqlens`/`document_ids`) but no "
    "attention was swapped to keep their documents apart, so every token attends across "
    "the documents of its row (the loss and the throughput are not those of the documents "
    "trained apart). Add `AttentionSwap()` to the Trainer's callbacks, or call "
    "`swap_attention(model)` and run each step inside `packed_documents(batch)`."
)
_ATTENTION_SWAP = "lightning_speedkit.attention.attention_swap"


def documents_kept_apart(
    callbacks: Iterable[L.Callback], model: nn.Module, transformers_varlen: bool = False
) -> bool:
    """Whether attention in ``model`` takes a packed batch's documents: AttentionSwap among
    ``callbacks`` (it also says itself what it could not swap), a module of ``model``
    swapped by ``swap_attention``, or, for a batch of transformers' flash-attention
    arguments (``transformers_varlen``), a transformers model set to flash attention,
    whose variable-length kernel reads them itself."""
    module = sys.modules.get(_ATTENTION_SWAP)  # never imported here: see the module docstring
    swap = getattr(module, "AttentionSwap", None)
    if swap is not None and any(isinstance(callback, swap) for callback in callbacks):
        return True
    if transformers_varlen and any(_flash_attention(m) for m in model.modules()):
        return True
    return any(_surgery.replaced_forward(m) is not None for m in model.modules())


def _flash_attention(module: nn.Module) -> bool:
    """A transformers model whose config runs flash attention (``flash_attention_2``,
    ``flash_attention_3``, a hub kernel of flash-attn): it takes ``cu_seq_lens_q``."""
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return isinstance(implementation, str) and "flash" in implementation


def warn_if_documents_mix(
    info: BatchInfo | None, trainer: L.Trainer, model: L.LightningModule
) -> None:
    """At the end of the fit's first packed batch (``info.first_packed``), warn (rank 0)
    when nothing keeps its documents apart; every other batch returns at once."""
    if info is None or not info.first_packed:
        return
    callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    if not documents_kept_apart(callbacks, model, info.transformers_varlen):
        rank_zero_warn(MIXED_DOCUMENTS)
