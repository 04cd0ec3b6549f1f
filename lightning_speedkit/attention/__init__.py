"""Fused attention for any model: AttentionSwap, swap_attention, adapters and backends."""

from lightning_speedkit.attention._documents import packed_documents
from lightning_speedkit.attention.adapters import (
    AttentionAdapter,
    SwapContext,
    register_adapter,
    unregister_adapter,
)
from lightning_speedkit.attention.attention_swap import AttentionSwap
from lightning_speedkit.attention.backends import BACKENDS, Attend
from lightning_speedkit.attention.swap import ModuleSwap, SwapReport, swap_attention

__all__ = [
    "BACKENDS",
    "Attend",
    "AttentionAdapter",
    "AttentionSwap",
    "ModuleSwap",
    "SwapContext",
    "SwapReport",
    "packed_documents",
    "register_adapter",
    "swap_attention",
    "unregister_adapter",
]
