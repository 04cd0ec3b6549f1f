"""Grouping operator and kernel names into the breakdown's categories, and CUDA kernel
names shortened to what they compute (the rows of the top-operators table).

A name's category is found by substring, in the order host_sync, communication,
attention, matmul, memory_copy, elementwise otherwise (the tables below); bookkeeping
regions have none (their children decide). A kernel's category also depends on the
operator that launched it: eager attention's matmuls are attention, a cast launched by
``aten::copy_`` is a copy.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any

from lightning_speedkit.measure.report.trace import _Event

_COMM = (
    "c10d::",
    "gloo:",
    "nccl",
    "allreduce",
    "all_reduce",
    "allgather",
    "all_gather",
    "reduce_scatter",
    "reducescatter",
    "broadcast",
    "record_param_comms",
    "all_to_all",
)
_SYNC_OPS = ("aten::_local_scalar_dense", "aten::item")
_SYNC_RUNTIME = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaStreamWaitEvent",
)
_FUSED_ATTENTION = (
    "scaled_dot_product",
    "flash",
    "fmha",
    "efficient_attention",
    "cudnn_attention",
    "memory_efficient_attention",
    "flex_attention",
)
_ATTENTION = (*_FUSED_ATTENTION, "softmax", "aten::bmm", "aten::baddbmm", "attention")
#: A loss's softmax (cross-entropy's log-softmax, its CUDA kernels' epilogue): not attention.
_LOSS_SOFTMAX = ("log_softmax", "logsoftmax")
_MATMUL = (
    "aten::mm",
    "aten::addmm",
    "aten::matmul",
    "aten::linear",
    "aten::addmv",
    "aten::_convolution",
    "aten::convolution",
    "mkldnn_convolution",
    "gemm",
    "cutlass",
    "xmma",
    "nvjet",
    "wgmma",
    "cublas",
    "aten::_scaled_mm",
)
_COPY = (
    "aten::copy_",
    "aten::_to_copy",
    "aten::to",
    "aten::clone",
    "aten::contiguous",
    "memcpy",
    "memset",
)
_BOOKKEEPING = (
    "autograd::engine",
    "ProfilerStep#",
    "Optimizer.",
    "enumerate(DataLoader)",
    "speedkit/",
    "[pl]",
    "[LightningModule]",
    "[Strategy]",
    "[Callback]",
    "[_",
    "[LightningDataModule]",
    "[Trainer]",
)


def _has(name: str, needles: Iterable[str]) -> bool:
    lowered = name.lower()
    return any(n.lower() in lowered for n in needles)


@functools.lru_cache(maxsize=65536)
def _category(name: str) -> str | None:
    """An operator's or kernel's category; None for bookkeeping (its children decide)."""
    if name.startswith(_BOOKKEEPING) or name.endswith("Backward0") or name.startswith("detach"):
        return None
    if name in _SYNC_OPS or name in _SYNC_RUNTIME:
        return "host_sync"
    if _has(name, _COMM):
        return "communication"
    if _has(name, _LOSS_SOFTMAX):
        return "elementwise"
    if _has(name, _ATTENTION):
        return "attention"
    if _has(name, _MATMUL):
        return "matmul"
    if _has(name, _COPY):
        return "memory_copy"
    return "elementwise"


def _kernel_category(kernel: _Event, ops: Mapping[Any, _Event]) -> str:
    if kernel.cat != "kernel":
        return "memory_copy"
    category = _category(kernel.name) or "elementwise"
    op = ops.get(kernel.args.get("External id"))
    if category == "attention" and op is not None and _has(op.name, _LOSS_SOFTMAX):
        return "elementwise"  # a softmax kernel that cross-entropy launched
    if category in ("elementwise", "matmul"):
        launched_by = _category(op.name) if op is not None else None
        if launched_by == "attention":  # eager attention's matmuls and softmax
            return "attention"
        if category == "elementwise" and (
            launched_by == "memory_copy" or "copy_kernel" in kernel.name
        ):
            return "memory_copy"  # dtype casts and layout copies, as on the CPU (aten::copy_)
    return category


# Template arguments that say nothing about what a kernel computes.
_KERNEL_NOISE = re.compile(
    r"\b(?:array|TrivialOffsetCalculator|OffsetCalculator|LoadWithCast|StoreWithCast|"
    r"LoadWithoutCast|StoreWithoutCast|TensorListMetadata|TensorListScalarListMetadata)<[^<>]*>"
)
_PLAIN_TEMPLATE_ARG = re.compile(r"[\d\s]+u?l?|true|false|unsigned int|int|long|char\*|bool")


@functools.lru_cache(maxsize=4096)  # a trace repeats a few hundred names thousands of times
def _short_kernel_name(name: str, limit: int = 100) -> str:
    """A CUDA kernel's demangled name, short enough to read: what it computes, not how.

    ``void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>,
    std::array<char*, 3ul> >(int, ...)`` becomes
    ``vectorized_elementwise_kernel<CUDAFunctor_add<float>>``: no parameter list, no
    namespaces, no lambda chains (``direct_copy_kernel_cuda(...)::{lambda()#3}::...``
    becomes ``direct_copy_kernel_cuda``), no numeric or bookkeeping template arguments.
    Kernels that differ only in those (tile sizes, vector widths) share a row.
    """
    s = name.strip().removeprefix("void ").replace("(anonymous namespace)::", "")
    for _ in range(8):  # f(args)::{lambda()#3}::operator()() const::{lambda(float)#1}
        t = re.sub(r"::operator\(\)\([^()]*\)(?: const)?", "", s)
        t = re.sub(r"::\{lambda\([^{}]*\)#\d+\}", "", t)
        t = re.sub(r"(\w)\([^()<>]*\)(?=::|[,>])", r"\1", t)
        if t == s:
            break
        s = t
    s = re.sub(r"\b(?:\w+::)+", "", s)
    s = _simplify_template(re.sub(r"\s+", " ", _KERNEL_NOISE.sub("", s)).strip())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _simplify_template(name: str) -> str:
    """``name`` without its parameter list, and its template arguments simplified."""
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0:
            name = name[:i].rstrip()
            break
    bracket = name.find("<")
    if bracket < 0 or not name.endswith(">"):
        return name
    head, inner = name[:bracket], name[bracket + 1 : -1]
    args, depth, start = [], 0, 0
    for i, ch in enumerate(inner + ","):
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif ch == "," and depth == 0:
            arg = inner[start:i].strip()
            start = i + 1
            if arg and not _PLAIN_TEMPLATE_ARG.fullmatch(arg):
                args.append(_simplify_template(arg))
    return f"{head}<{', '.join(args)}>" if args else head
