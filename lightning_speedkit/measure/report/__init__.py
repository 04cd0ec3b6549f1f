"""From a profiler trace to a diagnosis: where a step's time goes, and the one-line fix.

``analyze_trace`` reads a chrome trace written by ``torch.profiler`` (ours from
:class:`~lightning_speedkit.ProfilerSchedule`, Lightning's ``PyTorchProfiler``, or a
plain ``torch.profiler.profile``; gzip or not) and returns a :class:`Report`:

- ``breakdown``: each step's wall time split into :data:`CATEGORIES` (fractions that
  add up to 1). On a CPU-only trace the main thread is the device: every instant of
  it goes to the innermost operator running then (its self time), to data loading
  inside the loader's regions, to communication when another thread is in a
  collective while the main thread is not computing, and to ``overhead`` (Python,
  framework, waiting) otherwise. With CUDA kernels in the trace the GPU is the
  device: busy time goes to the kernels' categories (compute wins where it overlaps
  communication, so only exposed communication counts); idle time to data when the
  host is fetching a batch, to ``host_sync`` when the host has just waited for the
  device, and to ``overhead`` (launch-bound host) otherwise.
- ``modules``: each top-level child module's share of forward time.
- ``findings``: the decision tree of the spec, each with its numbers (``evidence``)
  and the fix the kit offers (``fix``), most costly first.

Thresholds are module constants (``DATA_SHARE`` ...) and can be read in the report.
"""

from __future__ import annotations

import ast
import bisect
import functools
import gzip
import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["CATEGORIES", "Finding", "Report", "analyze_trace", "load_trace"]

#: Where a step's time goes (``Report.breakdown`` keys, in this order).
CATEGORIES = (
    "data",
    "host_sync",
    "communication",
    "attention",
    "matmul",
    "elementwise",
    "memory_copy",
    "overhead",
)
#: Finding kinds, in the order the decision tree asks.
KINDS = ("data", "host_sync", "attention", "communication", "vision_encoder", "memory", "compute")

DATA_SHARE = 0.10  #: data wait above this share of the step is a finding
HOST_SYNC_SHARE = 0.05  #: syncs outside the user's code above this share are a finding
HOST_BOUND_SHARE = 0.30  #: device idle (unexplained) above this share: a host-bound step
ATTENTION_SHARE = 0.15  #: unfused attention above this share is a finding
COMMUNICATION_SHARE = 0.30  #: exposed communication above this share is a finding
VISION_SHARE = 0.40  #: a vision tower above this share of step time is flagged
MEMORY_SHARE = 0.90  #: peak memory above this share of the device is a finding
COPY_SHARE = 0.15  #: copies and dtype casts above this share name the compute finding
BINS_PER_STEP = 20_000  #: timeline resolution

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
_DATA_REGIONS = ("speedkit/data_fetch", "train_dataloader_next", "enumerate(DataLoader)")
_LIBRARY_FRAMES = re.compile(
    r"(^|/)(torch|lightning|pytorch_lightning|lightning_fabric|lightning_utilities|"
    r"lightning_speedkit|torchmetrics|deepspeed|transformers|timm|numpy)/|^<frozen "
)
_FRAME = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<func>.+)$")
_SYNC_CALLS = re.compile(r"\.(item|cpu|tolist|numpy)\(|torch\.cuda\.synchronize|\.to\([\"']cpu")
_VISION = re.compile(r"vision|visual|image|img|vit|pixel|patch", re.IGNORECASE)


@dataclass
class Finding:
    """One diagnosis: what (``kind``), how much (``share`` of step time), the numbers
    behind it (``evidence``) and the fix the kit offers (``fix``)."""

    kind: str
    share: float
    evidence: str
    fix: str
    details: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.kind}: {self.evidence} -> {self.fix}"


@dataclass
class Report:
    """A window's diagnosis; see the module docstring for how each figure is made."""

    source: str
    device: str
    steps: int
    step_ms: float
    breakdown: dict[str, float]
    modules: dict[str, float]
    top_ops: list[dict[str, Any]]
    sync_sites: list[dict[str, Any]]
    findings: list[Finding]
    memory: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def kinds(self) -> list[str]:
        """The findings' kinds, most costly first."""
        return [f.kind for f in self.findings]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_markdown(self) -> str:
        lines = [
            "# speedkit report",
            "",
            f"{self.source}: {self.steps} step(s) on {self.device}, "
            f"{self.step_ms:.1f} ms per step.",
            "",
            "## Findings",
            "",
        ]
        for i, finding in enumerate(self.findings, 1):
            lines.append(
                f"{i}. **{finding.kind}** ({finding.share:.0%} of the step): {finding.evidence}  "
            )
            lines.append(f"   Fix: {finding.fix}")
        if not self.findings:
            lines.append("Nothing stands out.")
        lines += [f"\nNote: {note}." for note in self.notes]
        lines += [
            "",
            "## Where the step goes",
            "",
            "| category | share | ms per step |",
            "|---|---:|---:|",
        ]
        for name in CATEGORIES:
            share = self.breakdown.get(name, 0.0)
            lines.append(f"| {name} | {share:.1%} | {share * self.step_ms:.2f} |")
        if self.modules:
            lines += [
                "",
                "## Top-level modules (share of forward time)",
                "",
                "| module | share |",
                "|---|---:|",
            ]
            lines += [f"| {name} | {share:.1%} |" for name, share in self.modules.items()]
        if self.sync_sites:
            lines += [
                "",
                "## Host-device syncs in the step",
                "",
                "| call site | calls per step | ms per step |",
                "|---|---:|---:|",
            ]
            lines += [
                f"| `{s['site']}` | {s['per_step']:.1f} | {s['ms_per_step']:.3f} |"
                for s in self.sync_sites
            ]
        if self.top_ops:
            lines += [
                "",
                "## Top operators by self time",
                "",
                "| operator | category | ms per step | share |",
                "|---|---|---:|---:|",
            ]
            lines += [
                f"| `{op['name']}` | {op['category']} | {op['ms_per_step']:.2f} "
                f"| {op['share']:.1%} |"
                for op in self.top_ops
            ]
        return "\n".join(lines) + "\n"

    def write(self, directory: str | Path, stem: str = "speedkit_report") -> list[Path]:
        """Write ``<stem>.md``, ``<stem>.json`` and, with matplotlib, ``<stem>.png``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        md, js = directory / f"{stem}.md", directory / f"{stem}.json"
        md.write_text(self.to_markdown())
        js.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        written = [md, js]
        png = self.plot(directory / f"{stem}.png")
        if png is not None:
            written.append(png)
        return written

    def plot(self, path: str | Path) -> Path | None:
        """Step-time breakdown and module shares as one PNG (None without matplotlib)."""
        try:
            import matplotlib
        except ImportError:
            return None
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = 2 if self.modules else 1
        fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 3.6), squeeze=False)
        names = [c for c in CATEGORIES if self.breakdown.get(c, 0.0) > 0]
        shares = [100 * self.breakdown[c] for c in names]
        ax = axes[0][0]
        bars = ax.barh(names[::-1], shares[::-1], color="#4c72b0")
        ax.bar_label(bars, fmt="%.1f%%", padding=2, fontsize=8)
        ax.set_xlabel("% of step time")
        ax.set_title(f"step {self.step_ms:.1f} ms ({self.device})")
        ax.set_xlim(0, max(shares, default=1) * 1.25)
        if self.modules:
            ax = axes[0][1]
            labels = list(self.modules)
            values = [100 * v for v in self.modules.values()]
            bars = ax.barh(labels[::-1], values[::-1], color="#dd8452")
            ax.bar_label(bars, fmt="%.1f%%", padding=2, fontsize=8)
            ax.set_xlabel("% of forward time")
            ax.set_title("top-level modules")
            ax.set_xlim(0, max(values, default=1) * 1.25)
        kinds = ", ".join(self.kinds) or "nothing stands out"
        fig.suptitle(f"speedkit report: {kinds}", fontsize=10)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


_ALREADY_ON = {
    "data": (
        "NumWorkersTuner",
        "NumWorkersTuner is already on and this is what it could do: the loader has no "
        "spare cores for more workers here. Make each sample cheaper: decode it once "
        "(SpeedDataModuleMixin's speed_dataloader(..., cache=True), for a dataset that "
        "fits in memory and augments after loading), smaller images; or give the loader "
        "cores",
    ),
    "attention": (
        "AttentionSwap",
        "AttentionSwap is already on: the attention left unfused is in modules it "
        "reverted (parity) or did not recognise; its report says which",
    ),
}


def amend_for_callbacks(report: Report, callbacks: Iterable[str]) -> None:
    """Say so where a finding's fix is a callback the run already has (by class name)."""
    present = set(callbacks)
    for finding in report.findings:
        name, fix = _ALREADY_ON.get(finding.kind, ("", ""))
        if name in present:
            finding.fix = fix


# ---------------------------------------------------------------------------------- reading


def load_trace(trace: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A chrome trace as a dict (a path to ``.json`` or ``.json.gz``, or the dict itself)."""
    if isinstance(trace, Mapping):
        given = dict(trace)
        if isinstance(given.get("traceEvents"), list):
            _check_events(given, "The trace")
        return given
    path = Path(trace)
    if path.is_dir():
        raise SpeedkitConfigError(
            f"{path} is a directory, not a trace; give one of its .json or .json.gz traces."
        )
    if not path.is_file():
        raise SpeedkitConfigError(f"No trace at {path}.")
    opener: Any = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as handle:
            data = json.load(handle)
    except (OSError, ValueError, EOFError) as error:
        raise SpeedkitConfigError(
            f"{path} is not a chrome trace (JSON, optionally gzip): {error}"
        ) from error
    if isinstance(data, list):  # the bare-array form of the format
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise SpeedkitConfigError(f"{path} has no `traceEvents`: not a chrome trace.")
    _check_events(data, str(path))
    return data


def _check_events(data: Mapping[str, Any], where: str) -> None:
    """Refuse a trace the analysis cannot read, naming the first bad event: events are
    JSON objects, a complete event's (``"ph": "X"``) times are finite microseconds, its
    ids are numbers or strings, and memory figures are numbers."""
    fix = "give a trace written by torch.profiler (ProfilerSchedule, Lightning's PyTorchProfiler)"

    def refuse(what: str, value: Any, why: str) -> NoReturn:
        raise SpeedkitConfigError(f"{where}: {what} is {_shown(value)}, {why}; {fix}.")

    for i, event in enumerate(data["traceEvents"]):
        if not isinstance(event, dict):
            refuse(f"event {i}", event, "not a JSON object")
        args = event.get("args", {})
        if not isinstance(args, dict) and (args is not None or event.get("name") == "[memory]"):
            refuse(f"event {i}'s `args`", args, "not a JSON object")
        args = args or {}
        if event.get("name") == "[memory]" and not _is_number(args.get("Total Reserved", 0)):
            refuse(f"event {i}'s `Total Reserved`", args["Total Reserved"], "not a number")
        if event.get("ph") != "X" or "ts" not in event:
            continue  # instants, counters and metadata: the analysis reads no more of them
        for key in ("ts", "dur"):
            if key in event and not _is_number(event[key]):
                refuse(f"event {i}'s `{key}`", event[key], "not a finite number of microseconds")
        for key, value in [("tid", event.get("tid"))] + [(k, args.get(k)) for k in _IDS]:
            if isinstance(value, (list, dict)):
                refuse(f"event {i}'s `{key}`", value, "not an id (a number or a string)")
    devices = data.get("deviceProperties") or []
    if not isinstance(devices, list):
        refuse("`deviceProperties`", devices, "not a JSON array")
    for device in devices:
        if isinstance(device, dict) and not _is_number(device.get("totalGlobalMem", 0)):
            refuse("`deviceProperties`' `totalGlobalMem`", device["totalGlobalMem"], "not a number")


_IDS = ("correlation", "External id", "Python id", "Python parent id")
"""The ``args`` that link events (kernel to launch, Python frame to caller): dict keys."""


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return False
    try:
        return abs(float(value)) < float("inf")  # False for NaN too
    except ValueError:
        return False


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


@dataclass
class _Event:
    name: str
    cat: str
    start: float
    end: float
    tid: Any
    args: dict[str, Any]

    @property
    def dur(self) -> float:
        return self.end - self.start


def _events(data: Mapping[str, Any]) -> list[_Event]:
    out = []
    for e in data["traceEvents"]:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        start = float(e["ts"])
        out.append(
            _Event(
                str(e.get("name", "")),
                str(e.get("cat", "")),
                start,
                start + float(e.get("dur", 0.0)),
                e.get("tid"),
                e.get("args") or {},
            )
        )
    return out


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
    if _has(name, _ATTENTION):
        return "attention"
    if _has(name, _MATMUL):
        return "matmul"
    if _has(name, _COPY):
        return "memory_copy"
    return "elementwise"


# --------------------------------------------------------------------------------- analysis


class _Timeline:
    """A step's bins, each labelled with a category index (or -1: unlabelled)."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.width = max(end - start, 1e-3) / BINS_PER_STEP
        self.labels = np.full(BINS_PER_STEP, -1, dtype=np.int8)

    def span(self, start: float, end: float) -> slice:
        lo = int((max(start, self.start) - self.start) / self.width)
        hi = int(np.ceil((min(end, self.end) - self.start) / self.width))
        return slice(max(lo, 0), min(max(hi, lo), BINS_PER_STEP))

    def paint(self, start: float, end: float, category: str, only: Sequence[int] = ()) -> None:
        where = self.span(start, end)
        if where.stop <= where.start:
            return
        value = CATEGORIES.index(category)
        if only:
            part = self.labels[where]
            part[np.isin(part, only)] = value
        else:
            self.labels[where] = value


def _steps(events: list[_Event]) -> tuple[list[_Event], Any]:
    steps = sorted((e for e in events if e.name.startswith("ProfilerStep#")), key=lambda e: e.start)
    if steps:
        return steps, steps[0].tid
    ops = [e for e in events if e.cat == "cpu_op"]
    if not ops:
        raise SpeedkitConfigError("The trace has no operators: nothing to analyse.")
    counts: dict[Any, int] = defaultdict(int)
    for e in ops:
        counts[e.tid] += 1
    main = max(counts, key=lambda t: counts[t])
    mine = [e for e in ops if e.tid == main]
    whole = _Event("trace", "", min(e.start for e in mine), max(e.end for e in mine), main, {})
    return [whole], main


def _inside(items: list[_Event], starts: list[float], start: float, end: float) -> list[_Event]:
    """Events of ``items`` (sorted by start) that start within [start, end)."""
    lo, hi = bisect.bisect_left(starts, start), bisect.bisect_left(starts, end)
    return items[lo:hi]


def analyze_trace(
    trace: str | Path | Mapping[str, Any],
    *,
    memory: tuple[float, float] | None = None,
    source: str | None = None,
    unprofiled_data_share: float | None = None,
    unprofiled_step_ms: float | None = None,
) -> Report:
    """Diagnose a chrome trace of training steps (see the module docstring).

    Args:
        trace: a path (``.json`` or ``.json.gz``) or the loaded trace.
        memory: ``(peak_bytes, device_bytes)`` when known (the callback passes the
            accelerator's); otherwise read from the trace's memory events, if any.
        source: the name the report gives the trace (default: its path).
        unprofiled_data_share: on a CPU-only trace, the data-wait share measured on
            steps the profiler did not record (ProfilerSchedule passes it). The
            profiler's Python tracing slows a Python-heavy loader several times more
            than the model's native operators, so the trace alone overstates data wait;
            given this, ``data`` takes this share and the rest is scaled to fit.
        unprofiled_step_ms: on a trace with CUDA kernels, the median step time of steps
            the profiler did not record. Kernels run at full speed under the profiler
            but the host does not (Python stacks), and the device idles for it: given
            this, kernel time is kept and ``overhead`` becomes what the real step leaves.
    """
    data = load_trace(trace)
    source = source or (str(trace) if not isinstance(trace, Mapping) else "trace")
    events = sorted(_events(data), key=lambda e: e.start)
    steps, main = _steps(events)
    device_events = [e for e in events if e.cat in ("kernel", "gpu_memcpy", "gpu_memset")]
    on_device = bool(device_events)
    host = [
        e
        for e in events
        if e.tid == main and e.cat in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
    ]
    host_starts = [e.start for e in host]
    comm_other = [
        e
        for e in events
        if e.tid != main and e.cat in ("cpu_op", "user_annotation") and _has(e.name, _COMM)
    ]
    launches = {e.args.get("correlation"): e for e in events if e.cat == "cuda_runtime"}
    ops_by_external = {e.args.get("External id"): e for e in host if e.cat == "cpu_op"}

    # Each kernel's category, once: the breakdown and the top-operators table share it.
    kinds = {id(k): _kernel_category(k, ops_by_external) for k in device_events}
    totals = np.zeros(len(CATEGORIES))
    op_self: dict[str, float] = defaultdict(float)
    op_category: dict[str, str] = {}
    step_time = 0.0
    for step in steps:
        timeline = _Timeline(step.start, step.end)
        step_time += step.dur
        mine = _inside(host, host_starts, step.start, step.end)
        if on_device:
            _paint_device(timeline, device_events, mine, kinds)
        else:
            _paint_host(timeline, mine, comm_other)
        for region in mine:
            if region.name.startswith(_DATA_REGIONS) or "train_dataloader_next" in region.name:
                if on_device:  # data wait is the device idle while the host fetches
                    timeline.paint(region.start, region.end, "data", only=(-1,))
                else:
                    timeline.paint(region.start, region.end, "data")
        labels = timeline.labels
        labels[labels == -1] = CATEGORIES.index("overhead")
        totals += np.bincount(labels, minlength=len(CATEGORIES))[: len(CATEGORIES)] * (
            timeline.width
        )
        for name, seconds, category in _self_times(mine, device_events, step, on_device, kinds):
            op_self[name] += seconds
            op_category[name] = category

    total = totals.sum() or 1.0
    breakdown = {name: float(totals[i] / total) for i, name in enumerate(CATEGORIES)}
    notes = []
    if unprofiled_data_share is not None and not on_device:
        traced, true = breakdown["data"], min(max(unprofiled_data_share, 0.0), 1.0)
        scale = (1.0 - true) / (1.0 - traced) if traced < 1.0 else 0.0
        breakdown = {k: (true if k == "data" else v * scale) for k, v in breakdown.items()}
        notes.append(
            f"data wait is {true:.1%} of the step as measured on unprofiled steps "
            f"({traced:.1%} in the trace, where the profiler slows the Python loader); "
            "the other shares are scaled to fit"
        )
    n = len(steps)
    step_ms = step_time / n / 1e3
    if unprofiled_step_ms is not None and on_device and 0 < unprofiled_step_ms < step_ms:
        # Kernels run as fast under the profiler; the host does not, and the device idles
        # for it. Keep the kernels' time and let the idle be what the real step leaves.
        spent = {k: v * step_ms for k, v in breakdown.items()}
        busy = sum(v for k, v in spent.items() if k != "overhead")
        spent["overhead"] = max(unprofiled_step_ms - busy, 0.0)
        total = sum(spent.values())
        notes.append(
            f"profiled steps took {step_ms:.1f} ms, un-profiled ones {unprofiled_step_ms:.1f} "
            f"ms: the profiler slows the host, so the device's idle time is taken as what "
            f"the un-profiled step leaves ({spent['overhead']:.1f} ms)"
        )
        breakdown = {k: v / total for k, v in spent.items()}
        step_ms = total
    top = sorted(op_self.items(), key=lambda kv: -kv[1])[:10]
    top_ops = [
        {
            "name": name,
            "category": op_category[name],
            "ms_per_step": us / n / 1e3,
            "share": us / n / 1e3 / step_ms,
        }
        for name, us in top
    ]
    modules = _module_shares(host, device_events, launches, on_device)
    sites = _sync_sites(events, host, n, step_time, on_device)
    memory_info = _memory(data, events, memory)
    unfused = any(_has(e.name, ("softmax",)) for e in host) and not any(
        _has(e.name, _FUSED_ATTENTION) for e in host + device_events
    )
    findings = _diagnose(
        breakdown, modules, sites, memory_info, unfused, step_ms, top_ops, on_device
    )
    return Report(
        source=source,
        device="cuda" if on_device else "cpu",
        steps=n,
        step_ms=step_ms,
        breakdown=breakdown,
        modules=modules,
        top_ops=top_ops,
        sync_sites=sites,
        findings=findings,
        memory=memory_info,
        notes=notes,
    )


def _paint_host(timeline: _Timeline, ops: list[_Event], comm_other: list[_Event]) -> None:
    # Outer first, inner last: each instant ends up with its innermost operator.
    for e in sorted((e for e in ops if e.cat == "cpu_op"), key=lambda e: -e.dur):
        category = _category(e.name)
        if category is not None:
            timeline.paint(e.start, e.end, category)
    idle = (-1,)
    for e in comm_other:  # a collective on another thread while the main thread waits
        timeline.paint(e.start, e.end, "communication", only=idle)


_DEVICE_ORDER = ("memory_copy", "communication", "elementwise", "matmul", "attention")


def _kernel_category(kernel: _Event, ops: Mapping[Any, _Event]) -> str:
    if kernel.cat != "kernel":
        return "memory_copy"
    category = _category(kernel.name) or "elementwise"
    if category in ("elementwise", "matmul"):
        op = ops.get(kernel.args.get("External id"))
        launched_by = _category(op.name) if op is not None else None
        if launched_by == "attention":  # eager attention's matmuls and softmax
            return "attention"
        if category == "elementwise" and (
            launched_by == "memory_copy" or "copy_kernel" in kernel.name
        ):
            return "memory_copy"  # dtype casts and layout copies, as on the CPU (aten::copy_)
    return category


def _paint_device(
    timeline: _Timeline,
    kernels: list[_Event],
    host: list[_Event],
    kinds: Mapping[int, str],
) -> None:
    mine = [k for k in kernels if k.end > timeline.start and k.start < timeline.end]
    labelled = [(k, kinds[id(k)]) for k in mine]
    for category in _DEVICE_ORDER:  # compute painted last wins over overlapped communication
        for kernel, kind in labelled:
            if kind == category:
                timeline.paint(kernel.start, kernel.end, category)
    busy_starts = sorted(k.start for k in mine)
    for e in host:  # idle from a sync's end to the next kernel: the drained pipeline
        if e.name in _SYNC_RUNTIME:
            i = bisect.bisect_left(busy_starts, e.end)
            resume = busy_starts[i] if i < len(busy_starts) else timeline.end
            timeline.paint(e.start, resume, "host_sync", only=(-1,))


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


def _self_times(
    host: list[_Event],
    kernels: list[_Event],
    step: _Event,
    on_device: bool,
    kinds: Mapping[int, str],
) -> list[tuple[str, float, str]]:
    if on_device:  # categories as in the breakdown
        return [
            (_short_kernel_name(k.name), k.dur, kinds[id(k)])
            for k in kernels
            if step.start <= k.start < step.end
        ]
    ops = [e for e in host if e.cat == "cpu_op"]
    out = []
    for i, e in enumerate(ops):  # self time: own duration minus direct children's
        children = 0.0
        end = e.start
        for c in ops[i + 1 :]:
            if c.start >= e.end:
                break
            if c.start >= end:  # a direct child (nested ones lie inside it)
                children += min(c.end, e.end) - c.start
                end = c.end
        category = _category(e.name)
        if category is not None:
            out.append((e.name, max(e.dur - children, 0.0), category))
    return out


def _module_name(region: str) -> str | None:
    if region.startswith("speedkit/module/"):
        return region[len("speedkit/module/") :]
    if region.startswith("[pl][module]"):  # Lightning's PyTorchProfiler: "<type>: <name>"
        return region.split(": ", 1)[-1] or None
    return None


def _top_level_names(names: set[str]) -> set[str]:
    """The module names whose shares the report gives, from every depth's names.

    Lightning's PyTorchProfiler marks modules at every depth (``model``, ``model.vision``,
    ``model.vision.blocks.0``, ...). As ProfilerSchedule does, take the LightningModule's
    children, or while there is a single one with children of its own (``self.model``),
    its children: one depth only, so that no time is counted twice.
    """
    level = {n for n in names if "." not in n}
    while len(level) == 1:
        (only,) = level
        children = {n for n in names if n.startswith(only + ".") and "." not in n[len(only) + 1 :]}
        if not children:
            break
        level = children
    return level


def _module_shares(
    host: list[_Event], kernels: list[_Event], launches: Mapping[Any, _Event], on_device: bool
) -> dict[str, float]:
    regions = [(name, e) for e in host if (name := _module_name(e.name)) is not None]
    if any(e.name.startswith("[pl][module]") for _, e in regions):
        keep = _top_level_names({name for name, _ in regions})
        regions = [(name, e) for name, e in regions if name in keep]
    if not regions:
        return {}
    times: dict[str, float] = defaultdict(float)
    if on_device:
        spans = sorted((e.start, e.end, name) for name, e in regions)
        starts = [s[0] for s in spans]
        for kernel in kernels:
            launch = launches.get(kernel.args.get("correlation"))
            if launch is None:
                continue
            i = bisect.bisect_right(starts, launch.start) - 1
            if i >= 0 and spans[i][0] <= launch.start < spans[i][1]:
                times[spans[i][2]] += kernel.dur
    else:
        for name, e in regions:
            times[name] += e.dur
    total = sum(times.values()) or 1.0
    ordered = sorted(times.items(), key=lambda kv: -kv[1])
    return {name: t / total for name, t in ordered}


def _python_frames(events: list[_Event]) -> tuple[list[_Event], dict[Any, _Event]]:
    frames = [e for e in events if e.cat == "python_function"]
    by_id = {e.args.get("Python id"): e for e in frames}
    return frames, by_id


def _user_frame(
    op: _Event, frames: list[_Event], starts: list[float], by_id: Mapping[Any, _Event]
) -> tuple[str, bool]:
    """The Python frame that made ``op``'s call, and whether it is the user's code.

    The innermost enclosing frame that is not a built-in decides: a sync made inside
    torch or Lightning is theirs (named, but not blamed on the user's step).
    """
    # Frames are sorted by start: the innermost enclosing one is the latest-starting
    # frame before the op that still runs when the op ends.
    inner = None
    i = bisect.bisect_right(starts, op.start) - 1
    while i >= 0:
        f = frames[i]
        if f.tid == op.tid and f.end >= op.end:
            inner = f
            break
        i -= 1
    seen = 0
    while inner is not None and seen < 64:
        match = _FRAME.match(inner.name)
        if match:
            if _LIBRARY_FRAMES.search(match["file"]):
                return f"{match['file']}:{match['line']} in {match['func']}", False
            return _call_line(match["file"], int(match["line"]), match["func"]), True
        inner = by_id.get(inner.args.get("Python parent id"))
        seen += 1
    return "unknown (profile with with_stack=True to name it)", False


def _call_line(file: str, first_line: int, func: str) -> str:
    """Profilers record a function's first line; find the syncing call in its body."""
    candidates = [Path(file), *(Path(p) / file for p in sys.path if p)]
    for path in candidates:
        try:
            source = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        try:
            tree = ast.parse(source)
        except SyntaxError:
            break
        lines = source.splitlines()
        for node in ast.walk(tree):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.name == func
                and node.lineno <= first_line <= (node.end_lineno or node.lineno)
            ):
                body = range(node.lineno, (node.end_lineno or node.lineno) + 1)
                hits = [i for i in body if _SYNC_CALLS.search(lines[i - 1])]
                if hits:
                    return f"{file}:{hits[0]} in {func}: {lines[hits[0] - 1].strip()}"
        break
    return f"{file}:{first_line} in {func}"


def _sync_sites(
    events: list[_Event], host: list[_Event], steps: int, step_time: float, on_device: bool
) -> list[dict[str, Any]]:
    runtime = [e for e in host if e.name in _SYNC_RUNTIME]
    # An item() shows as _local_scalar_dense, with the runtime sync inside it on CUDA. On a
    # device trace one without a sync inside read a CPU tensor (an optimizer's step count):
    # that waits for nothing.
    scalars = [e for e in host if e.name == "aten::_local_scalar_dense"]
    if on_device:
        scalars = [o for o in scalars if any(o.start <= e.start <= o.end for e in runtime)]
    rest = [e for e in runtime if not any(o.start <= e.start <= o.end for o in scalars)]
    if not scalars and not rest:
        return []
    outer = scalars
    frames, by_id = _python_frames(events)
    starts = [f.start for f in frames]
    sites: dict[tuple[str, bool], list[float]] = defaultdict(list)
    for e in outer + rest:
        sites[_user_frame(e, frames, starts, by_id)].append(e.dur)
    rows = [
        {
            "site": site,
            "user_code": user,
            "per_step": len(d) / steps,
            "ms_per_step": sum(d) / steps / 1e3,
            "share": sum(d) / step_time,
        }
        for (site, user), d in sites.items()
    ]
    return sorted(rows, key=lambda r: -r["per_step"])


def _memory(
    data: Mapping[str, Any], events: list[_Event], given: tuple[float, float] | None
) -> dict[str, float] | None:
    if given is not None:
        peak, capacity = given
    else:
        props = data.get("deviceProperties") or []
        capacity = max(
            (float(p.get("totalGlobalMem", 0)) for p in props if isinstance(p, dict)), default=0.0
        )
        peaks = [
            float(e.get("args", {}).get("Total Reserved", 0))
            for e in data["traceEvents"]
            if e.get("name") == "[memory]"
        ]
        peak = max(peaks, default=0.0)
    if not capacity or not peak:
        return None
    return {"peak_bytes": peak, "device_bytes": capacity, "share": peak / capacity}


def _diagnose(
    breakdown: Mapping[str, float],
    modules: Mapping[str, float],
    sites: list[dict[str, Any]],
    memory: Mapping[str, float] | None,
    unfused: bool,
    step_ms: float,
    top_ops: list[dict[str, Any]],
    on_device: bool,
) -> list[Finding]:
    findings = []
    data = breakdown["data"]
    if data >= DATA_SHARE:
        findings.append(
            Finding(
                "data",
                data,
                f"data wait {data:.0%} of the step ({data * step_ms:.1f} of {step_ms:.1f} ms): "
                "the model waits for the loader",
                "add NumWorkersTuner() to the callbacks (or SpeedDataModuleMixin); pin_memory=True "
                "on GPUs; LengthBucketBatchSampler for variable-length captions",
            )
        )
    # The user's own syncs are always worth naming (free on a CPU, a stall on a GPU); the
    # framework's, or unnamed ones (no stacks), only when they cost.
    blamed = [s for s in sites if s["user_code"]]
    if not blamed and breakdown["host_sync"] >= HOST_SYNC_SHARE:
        blamed = sites
    if blamed:
        share = max(sum(s["share"] for s in sites), breakdown["host_sync"])
        where = "; ".join(f"{s['site']} ({s['per_step']:.0f}x per step)" for s in blamed[:3])
        findings.append(
            Finding(
                "host_sync",
                share,
                f"host-device syncs in the step at {where}; {breakdown['host_sync']:.0%} of the "
                "step here. On an accelerator each one blocks the host until all queued work is "
                "done, so the GPU idles while the next kernels are launched",
                "keep the value on the device: self.log(name, tensor) instead of .item(); move "
                ".cpu()/.tolist() out of training_step (to a callback every N steps)",
                {"sites": blamed},
            )
        )
    attention = breakdown["attention"]
    if unfused and attention >= ATTENTION_SHARE:
        findings.append(
            Finding(
                "attention",
                attention,
                f"unfused attention (softmax and batched matmuls, no fused kernel) takes "
                f"{attention:.0%} of the step",
                "add AttentionSwap() to the callbacks (or swap_attention(model, 'auto')): fused "
                "SDPA/flash kernels, parity-checked",
            )
        )
    comm = breakdown["communication"]
    if comm >= COMMUNICATION_SHARE:
        findings.append(
            Finding(
                "communication",
                comm,
                f"exposed gradient communication {comm:.0%} of the step (not overlapped with "
                "compute)",
                "strategy='ddp_powersgd' (or 'ddp_bf16_compress' on fast links); "
                "AccumulationScheduler(adaptive=True) to sync less often",
            )
        )
    compute = sum(breakdown[c] for c in ("attention", "matmul", "elementwise", "memory_copy"))
    for name, forward_share in modules.items():
        share = forward_share * compute  # its backward scales with its forward
        if _VISION.search(name) and share >= VISION_SHARE:
            findings.append(
                Finding(
                    "vision_encoder",
                    share,
                    f"the vision tower `{name}` takes {forward_share:.0%} of forward time, "
                    f"about {share:.0%} of the step",
                    "freeze it and cache its features if it is not trained; lower the image "
                    "resolution or token count; AttentionSwap() for its attention",
                )
            )
            break
    if memory is not None and memory["share"] >= MEMORY_SHARE:
        findings.append(
            Finding(
                "memory",
                memory["share"],
                f"peak memory {memory['peak_bytes'] / 2**30:.1f} of "
                f"{memory['device_bytes'] / 2**30:.1f} GiB ({memory['share']:.0%})",
                "`speedkit plan --model MODULE:FACTORY --gpus N --gpu-mem GIB` for a preset that "
                "fits (strategy='fsdp_zero2' or 'deepspeed_zero2'); ActivationCheckpointing()",
            )
        )
    if not any(f.kind not in ("host_sync", "memory") for f in findings):
        heaviest = ", ".join(f"{op['name'][:60]} {op['share']:.0%}" for op in top_ops[:3])
        idle, copies = breakdown["overhead"], breakdown["memory_copy"]
        if on_device and idle >= HOST_BOUND_SHARE:
            evidence = (
                f"host-bound: the device idles {idle:.0%} of the step with no data wait or "
                f"sync to blame (kernels {compute:.0%}, matmul {breakdown['matmul']:.0%}): "
                "the host does not launch work fast enough"
            )
            fix = (
                "torch.compile (fewer, fused kernels) or CUDA graphs; a larger micro-batch "
                "per launch; fewer Python-side hooks per step"
            )
        elif copies >= COPY_SHARE and copies + breakdown["elementwise"] > breakdown["matmul"]:
            evidence = (
                f"compute-bound, and copies and dtype casts take {copies:.0%} of the step "
                f"(elementwise {breakdown['elementwise']:.0%}, matmul "
                f"{breakdown['matmul']:.0%}); heaviest: {heaviest}"
            )
            fix = (
                "fewer copies: under autocast each fp32 result (norms, softmax, residual "
                "adds) is cast again before the next matmul, and .contiguous()/.reshape() "
                "copy transposed tensors; torch.compile fuses casts and copies into the "
                "kernels around them"
            )
        elif breakdown["elementwise"] > breakdown["matmul"]:
            evidence = (
                f"compute-bound, and elementwise kernels ({breakdown['elementwise']:.0%}: "
                f"optimizer, casts, norms, activations) outweigh the matmuls "
                f"({breakdown['matmul']:.0%}); heaviest: {heaviest}"
            )
            fix = (
                "a fused optimizer (torch.optim.AdamW(fused=True)), torch.compile to fuse "
                "the elementwise chains; bf16-mixed if not already"
            )
        else:
            evidence = (
                f"compute-bound: operators {compute:.0%} of the step (matmul "
                f"{breakdown['matmul']:.0%}); heaviest: {heaviest}"
            )
            fix = (
                "bf16-mixed precision if not already, a larger micro-batch, torch.compile; "
                "SpeedMonitor's MFU says how far from the hardware's peak"
            )
        findings.append(Finding("compute", compute + (idle if on_device else 0.0), evidence, fix))
    return sorted(findings, key=lambda f: -f.share)
