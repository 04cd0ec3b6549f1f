"""``speedkit bench-attention``: every backend against eager attention, side by side.

For each shape (sequence length, head dim, key/value heads) it times forward +
backward of eager attention (explicit matmul, mask, softmax: what the example
VLM and much research code write) and of each backend through
:class:`~lightning_speedkit.attention.backends.Attend`, and measures memory:

* on CUDA, the peak memory allocated during forward + backward above the inputs;
* on CPU, the bytes attention saves for backward (what it holds between forward
  and backward; the allocator's peak is not observable there).

Shapes are timed interleaved (eager, backend, eager, ...) and the median is
kept, so drift on a shared machine hits all alike. A shape whose eager scores
would not fit the memory limit is skipped, not attempted.
"""

from __future__ import annotations

import json
import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_speedkit.attention.backends import BACKENDS, Attend, check_backend
from lightning_speedkit.errors import SpeedkitConfigError


@dataclass
class BenchRow:
    """One (shape, backend) measurement."""

    backend: str
    seq_len: int
    head_dim: int
    heads: int
    kv_heads: int
    batch: int
    dtype: str
    device: str
    ms: float | None
    """Median forward + backward time, in milliseconds."""
    memory_mib: float | None
    """Peak allocated (CUDA) or saved for backward (CPU), MiB."""
    speedup: float | None
    """Eager time / this backend's time."""
    memory_ratio: float | None
    """Eager memory / this backend's memory."""
    note: str = ""


def default_seq_lens(device: torch.device) -> list[int]:
    return [256, 512, 1024, 2048, 4096, 8192] if device.type == "cuda" else [256, 512, 1024, 2048]


def _eager(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v


class _SavedBytes:
    """Bytes of distinct storages autograd saves for backward inside the block."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _measure(
    fn: Callable[[], Tensor], inputs: Sequence[Tensor], device: torch.device
) -> tuple[float, float]:
    """Seconds and bytes of one forward + backward."""
    input_ptrs = {t.untyped_storage().data_ptr() for t in inputs}
    saved = _SavedBytes()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # SYNC: benchmark timing
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        out = fn()
    out.backward(torch.ones_like(out))
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # SYNC: benchmark timing
        memory = torch.cuda.max_memory_allocated(device) - base
    else:
        memory = sum(n for ptr, n in saved.storages.items() if ptr not in input_ptrs)
    elapsed = time.perf_counter() - start
    for t in inputs:
        t.grad = None
    return elapsed, float(memory)


def bench_attention(
    seq_lens: Sequence[int] | None = None,
    head_dims: Sequence[int] = (64,),
    heads: int = 8,
    kv_heads: Sequence[int] = (8, 2),
    batch: int = 1,
    backends: Sequence[str] = ("sdpa", "flash", "efficient", "cudnn", "math"),
    *,
    causal: bool = True,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    repeats: int = 5,
    memory_limit_gib: float = 8.0,
    progress: bool = True,
) -> list[BenchRow]:
    """Time and size eager attention and each backend over shapes; one row per pair.

    Args:
        seq_lens: sequence lengths (default 256-8192 on CUDA, 256-2048 on CPU).
        head_dims: head dimensions.
        heads: query heads.
        kv_heads: key/value head counts (equal to ``heads``: multi-head; fewer: GQA).
        batch: batch size.
        backends: backends to compare with eager.
        causal: causal masking (as a decoder).
        dtype: default bf16 on CUDA, fp32 on CPU.
        device: default CUDA when available.
        repeats: timed repeats per shape (median kept) after one warm-up.
        memory_limit_gib: skip shapes whose eager score matrices need more.
        progress: show a progress bar.

    Example::

        >>> rows = bench_attention([64], kv_heads=[8], backends=["sdpa"], repeats=1,
        ...                        device="cpu", progress=False)
        >>> [(r.backend, r.seq_len) for r in rows]
        [('eager', 64), ('sdpa', 64)]
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    seq_lens = list(seq_lens or default_seq_lens(dev))
    for backend in backends:
        check_backend(backend, allow_auto=False)
    for name, values in (("seq_lens", seq_lens), ("head_dims", head_dims), ("kv_heads", kv_heads)):
        if not values or min(values) < 1:
            raise SpeedkitConfigError(f"`{name}` must be positive integers, got {list(values)!r}.")
    for kv in kv_heads:
        if heads % kv:
            raise SpeedkitConfigError(
                f"`kv_heads={kv}` must divide `heads={heads}` (grouped-query attention)."
            )
    if repeats < 1 or batch < 1:
        raise SpeedkitConfigError(
            f"`repeats` and `batch` must be at least 1, got {repeats}, {batch}."
        )

    shapes = [(n, d, kv) for d in head_dims for kv in kv_heads for n in seq_lens]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(shapes), desc="bench-attention", unit="shape")
    rows: list[BenchRow] = []
    for n, d, kv in shapes:
        rows.extend(
            _bench_shape(
                n, d, heads, kv, batch, backends, causal, dtype, dev, repeats, memory_limit_gib
            )
        )
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return rows


def _bench_shape(
    n: int,
    d: int,
    heads: int,
    kv: int,
    batch: int,
    backends: Sequence[str],
    causal: bool,
    dtype: torch.dtype,
    dev: torch.device,
    repeats: int,
    memory_limit_gib: float,
) -> list[BenchRow]:
    def row(backend: str, ms: float | None, mem: float | None, note: str = "") -> BenchRow:
        return BenchRow(
            backend, n, d, heads, kv, batch, str(dtype).removeprefix("torch."), dev.type,
            ms, None if mem is None else mem / 2**20, None, None, note,
        )  # fmt: skip

    # Eager holds the scores and the probabilities (and on GQA repeated keys/values).
    eager_bytes = 2 * batch * heads * n * n * torch.finfo(dtype).bits // 8
    if eager_bytes > memory_limit_gib * 2**30:
        note = f"skipped: eager scores need {eager_bytes / 2**30:.1f} GiB > limit"
        return [row(b, None, None, note) for b in ("eager", *backends)]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, n, d, generator=generator).to(dev, dtype).requires_grad_()
    k = torch.randn(batch, kv, n, d, generator=generator).to(dev, dtype).requires_grad_()
    v = torch.randn(batch, kv, n, d, generator=generator).to(dev, dtype).requires_grad_()
    candidates: dict[str, Callable[[], Tensor]] = {"eager": lambda: _eager(q, k, v, causal)}
    attends = {backend: Attend(backend) for backend in backends}
    for backend, attend in attends.items():
        candidates[backend] = _bound(attend, q, k, v, causal)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    memory: dict[str, float] = {}
    failed: dict[str, str] = {}
    for i in range(repeats + 1):  # interleaved; the first round warms up
        for name, fn in candidates.items():
            if name in failed:
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # fallbacks are reported in the note
                    seconds, nbytes = _measure(fn, (q, k, v), dev)
            except torch.OutOfMemoryError:
                failed[name] = "out of memory"
                torch.cuda.empty_cache()
                continue
            if i:
                times[name].append(seconds)
            memory[name] = nbytes
    rows = []
    for name in candidates:
        if name in failed:
            rows.append(row(name, None, None, failed[name]))
            continue
        ran = attends[name].describe(dev) if name in attends else name
        note = "" if ran == name else f"ran {ran}"
        rows.append(row(name, statistics.median(times[name]) * 1e3, memory[name], note))
    eager = rows[0]
    for r in rows:
        if r.ms and eager.ms:
            r.speedup = eager.ms / r.ms
        if r.memory_mib and eager.memory_mib:
            r.memory_ratio = eager.memory_mib / r.memory_mib
    return rows


def _bound(attend: Attend, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Callable[[], Tensor]:
    return lambda: attend(q, k, v, is_causal=causal)


def format_table(rows: Sequence[BenchRow]) -> str:
    """Markdown table, one line per (shape, backend)."""
    lines = [
        "| seq | head dim | heads (kv) | backend | fwd+bwd ms | memory MiB | speed-up "
        "| memory saved | note |",
        "|---:|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ms = "-" if r.ms is None else f"{r.ms:.2f}"
        mem = "-" if r.memory_mib is None else f"{r.memory_mib:.1f}"
        speed = "-" if r.speedup is None else f"{r.speedup:.2f}x"
        ratio = "-" if r.memory_ratio is None else f"{r.memory_ratio:.1f}x"
        lines.append(
            f"| {r.seq_len} | {r.head_dim} | {r.heads} ({r.kv_heads}) | {r.backend} | {ms} "
            f"| {mem} | {speed} | {ratio} | {r.note} |"
        )
    return "\n".join(lines)


def write_json(rows: Sequence[BenchRow], path: Path, meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")


def plot(rows: Sequence[BenchRow], path: Path) -> Path:
    """Speed and memory relative to eager over sequence length, one panel per shape family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted({(r.head_dim, r.kv_heads) for r in rows})
    fig, axes = plt.subplots(
        2, len(families), figsize=(4.5 * len(families), 7), squeeze=False, sharex=True
    )
    for col, (d, kv) in enumerate(families):
        for backend in dict.fromkeys(r.backend for r in rows if r.backend != "eager"):
            mine = [r for r in rows if (r.head_dim, r.kv_heads, r.backend) == (d, kv, backend)]
            points = [(r.seq_len, r.speedup, r.memory_ratio) for r in mine if r.speedup]
            if not points:
                continue
            xs = [p[0] for p in points]
            axes[0][col].plot(xs, [p[1] for p in points], marker="o", label=backend)
            axes[1][col].plot(xs, [p[2] for p in points], marker="o", label=backend)
        heads = rows[0].heads
        axes[0][col].set_title(f"head dim {d}, {heads} heads, {kv} kv heads")
        for ax, label in zip(
            axes[:, col], ("speed vs eager (x)", "memory saved vs eager (x)"), strict=True
        ):
            ax.set_xscale("log", base=2)
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[1][col].set_xlabel("sequence length")
        axes[0][col].legend()
    first = rows[0]
    fig.suptitle(
        f"attention forward+backward vs eager, {first.device} {first.dtype}, batch {first.batch}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["BACKENDS", "BenchRow", "bench_attention", "format_table", "plot", "write_json"]
