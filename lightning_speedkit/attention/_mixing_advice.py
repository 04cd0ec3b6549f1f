"""What AttentionSwap says when a packed batch reached attention it did not swap: the fix
for each case.

A module no family matched, or one that failed its check, can be swapped
(``register_adapter``, ``tolerance=``). A transformers model whose family transformers runs
without SDPA (Gemma 2, BLOOM, GPT-Neo) cannot: the kit swaps transformers models through
their SDPA path, and teaching the kit the family would mean writing its attention again.
There the fix is transformers' own: its mask keeps packed documents apart where it reads
them off ``position_ids`` (recent versions, with no ``attention_mask`` and no cache;
measured on Gemma 2 and GPT-Neo, rows and one flattened row alike). A family whose forward
takes no ``position_ids`` (BLOOM, whose ALiBi biases run over the whole row) cannot keep
them apart at all: it must not be packed.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence

from torch import nn

__all__ = ["mixing_message"]

_SWAP_IT = (
    "wap it (`register_adapter` for a family the kit does not know; `tolerance=` for a module "
    "that failed its check), or write the document mask into that module, or do not pack."
)


def mixing_message(mixing: Sequence[str], modules: Mapping[str, nn.Module]) -> str:
    """The warning for ``mixing`` (the names of the modules that attended across documents;
    none: no attention was found), with the fix for each; ``modules``: the model's, by name.

    Example::

        >>> print(mixing_message(["h.1.attn"], {}))  # doctest: +NORMALIZE_WHITESPACE
        A packed batch (`cu_seqlens`/`document_ids`) reached attention that AttentionSwap did
        not swap, which attends across the documents of a row: 'h.1.attn'. Swap it
        (`register_adapter` for a family the kit does not know; `tolerance=` for a module
        that failed its check), or write the document mask into that module, or do not pack.
    """
    which = ", ".join(map(_quoted, mixing)) or "no attention was found"
    parts = [
        f"A packed batch (`cu_seqlens`/`document_ids`) reached attention that AttentionSwap did "
        f"not swap, which attends across the documents of a row: {which}."
    ]
    own = [n for n in mixing if n in modules and _without_sdpa(modules[n])]  # by name: a
    others = [n for n in mixing if n not in own]  # module's == may be anything (a Metric's)
    transformers = [modules[n] for n in own]
    if others and transformers:
        parts.append(f"For {', '.join(map(_quoted, others))}: s{_SWAP_IT}")
    elif not transformers:
        parts.append(f"S{_SWAP_IT}")
    apart = _classes(m for m in transformers if _takes_position_ids(m))
    never = _classes(m for m in transformers if not _takes_position_ids(m))
    if apart:
        parts.append(
            f"transformers runs {apart} without SDPA, so the kit cannot swap it "
            "(`register_adapter` would not help); transformers' own mask keeps the documents "
            "apart where it reads them off `position_ids` (recent versions): pack without "
            "`attention_mask`, pass the batch's `position_ids` and `use_cache=False` (this "
            "check cannot see that mask), or do not pack."
        )
    if never:
        parts.append(
            f"transformers runs {never} without SDPA and takes no `position_ids` (its "
            "positions run over the whole row), so neither the kit nor transformers can keep "
            "packed documents apart there: do not pack it (pad; `LengthBucketBatchSampler` "
            "keeps the padding small)."
        )
    return " ".join(parts)


def _quoted(name: str) -> str:
    return repr(name or "(root)")


def _classes(modules: Iterable[nn.Module]) -> str:
    """The modules' class names, each once, in order."""
    return ", ".join(dict.fromkeys(type(m).__name__ for m in modules))


def _without_sdpa(module: nn.Module) -> bool:
    """A transformers model whose family transformers runs without SDPA: one the kit's
    ``huggingface`` adapter skips, by its own test."""
    from lightning_speedkit.attention.adapters import _hf_match  # it imports _documents

    return isinstance(_hf_match(module), str)


def _takes_position_ids(module: nn.Module) -> bool:
    return "position_ids" in inspect.signature(type(module).forward).parameters
