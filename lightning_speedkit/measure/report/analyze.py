"""``analyze_trace``: a trace in, a :class:`Report` out.

It reads the trace (:mod:`.trace`), lays each step on a timeline (:mod:`.timeline`,
names grouped by :mod:`.kernels`), finds the sync call sites (:mod:`.sources`), and
runs the diagnosis's rules (:mod:`.rules`) on what it measured.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from lightning_speedkit.measure.report.kernels import (
    _COMM,
    _FUSED_ATTENTION,
    _LOSS_SOFTMAX,
    _has,
    _kernel_category,
)
from lightning_speedkit.measure.report.output import Report
from lightning_speedkit.measure.report.rules import Evidence, _diagnose
from lightning_speedkit.measure.report.sources import _sync_sites
from lightning_speedkit.measure.report.timeline import (
    _DATA_REGIONS,
    CATEGORIES,
    _inside,
    _module_shares,
    _paint_device,
    _paint_host,
    _self_times,
    _steps,
    _Timeline,
)
from lightning_speedkit.measure.report.trace import _Event, _events, _memory, load_trace


def analyze_trace(
    trace: str | Path | Mapping[str, Any],
    *,
    memory: tuple[float, float] | None = None,
    source: str | None = None,
    unprofiled_data_share: float | None = None,
    unprofiled_step_ms: float | None = None,
) -> Report:
    """Diagnose a chrome trace of training steps (see the package docstring).

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
    run = _sort_events(data)
    spent = _spend_steps(run)
    breakdown = _breakdown(spent.totals)
    notes = _device_notes(run)
    if unprofiled_data_share is not None and not run.on_device:
        breakdown, note = _with_unprofiled_data_share(breakdown, unprofiled_data_share)
        notes.append(note)
    n = len(run.steps)
    step_ms = spent.step_time / n / 1e3
    if unprofiled_step_ms is not None and run.on_device and 0 < unprofiled_step_ms < step_ms:
        breakdown, step_ms, note = _with_unprofiled_step(breakdown, step_ms, unprofiled_step_ms)
        notes.append(note)
    top_ops = _top_ops(spent, n, step_ms)
    modules = _module_shares(run.host, run.device_events, run.launches, run.on_device)
    sites = _sync_sites(run.events, run.host, n, spent.step_time, run.on_device)
    memory_info = _memory(data, run.events, memory)
    evidence = Evidence(breakdown, modules, sites, memory_info, _unfused_attention(run),
                        step_ms, top_ops, run.on_device, run.cuda_run)  # fmt: skip
    return Report(
        source=source,
        device="cuda" if run.cuda_run else "cpu",
        steps=n,
        step_ms=step_ms,
        breakdown=breakdown,
        modules=modules,
        top_ops=top_ops,
        sync_sites=sites,
        findings=_diagnose(evidence),
        memory=memory_info,
        notes=notes,
    )


@dataclass
class _Run:
    """A trace's events sorted by what the analysis reads them for."""

    events: list[_Event]
    """All of them, by start time."""
    steps: list[_Event]
    """The profiler's step ranges (``ProfilerStep#N``)."""
    device_events: list[_Event]
    """Kernels, copies and memsets on the device."""
    host: list[_Event]
    """The main thread's operators, regions and CUDA calls."""
    comm_other: list[_Event]
    """Collectives on other threads (a CPU run's communication)."""
    launches: dict[Any, _Event]
    """CUDA runtime calls by correlation id."""
    on_device: bool
    """Whether the trace holds the device's activity: the device is then the timeline."""
    cuda_run: bool
    """Whether the run used CUDA (its kernels, or at least its launches, are there)."""
    gpu_listed: bool
    """Whether the trace lists a GPU (torch lists the machine's GPUs in a CPU run too)."""


def _sort_events(data: Mapping[str, Any]) -> _Run:
    """Which events are the steps, the device's, the main thread's, other threads'
    collectives; and whether the device's activity is in the trace at all."""
    events = sorted(_events(data), key=lambda e: e.start)
    steps, main = _steps(events)
    device_events = [e for e in events if e.cat in ("kernel", "gpu_memcpy", "gpu_memset")]
    on_device = bool(device_events)
    host_cats = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
    return _Run(
        events=events,
        steps=steps,
        device_events=device_events,
        host=[e for e in events if e.tid == main and e.cat in host_cats],
        comm_other=[
            e
            for e in events
            if e.tid != main and e.cat in ("cpu_op", "user_annotation") and _has(e.name, _COMM)
        ],
        launches={e.args.get("correlation"): e for e in events if e.cat == "cuda_runtime"},
        on_device=on_device,
        # A CUDA run whose kernels the trace lacks still shows its launches (CUDA runtime
        # calls): its fixes are a GPU's. A listed GPU alone says nothing of the run (torch
        # lists the machine's GPUs in a CPU run's trace too): a note, not the advice.
        cuda_run=on_device or any(e.cat in ("cuda_runtime", "cuda_driver") for e in events),
        gpu_listed=bool(data.get("deviceProperties")),
    )


@dataclass
class _Spent:
    """Where the steps' time went: per category, and per operator (self time)."""

    totals: npt.NDArray[np.float64]
    """Seconds per category, in the order of CATEGORIES."""
    op_self: dict[str, float]
    op_category: dict[str, str]
    step_time: float


def _spend_steps(run: _Run) -> _Spent:
    """Lay each step on a timeline (the device's when the trace holds it, else the main
    thread's), data wait painted over it, and add up each category's bins and each
    operator's self time over the steps."""
    ops_by_external = {e.args.get("External id"): e for e in run.host if e.cat == "cpu_op"}
    # Each kernel's category, once: the breakdown and the top-operators table share it.
    kinds = {id(k): _kernel_category(k, ops_by_external) for k in run.device_events}
    host_starts = [e.start for e in run.host]
    spent = _Spent(np.zeros(len(CATEGORIES)), defaultdict(float), {}, 0.0)
    for step in run.steps:
        timeline = _Timeline(step.start, step.end)
        spent.step_time += step.dur
        mine = _inside(run.host, host_starts, step.start, step.end)
        if run.on_device:
            _paint_device(timeline, run.device_events, mine, kinds)
        else:
            _paint_host(timeline, mine, run.comm_other)
        for region in mine:
            if region.name.startswith(_DATA_REGIONS) or "train_dataloader_next" in region.name:
                if run.on_device:  # data wait is the device idle while the host fetches
                    timeline.paint(region.start, region.end, "data", only=(-1,))
                else:
                    timeline.paint(region.start, region.end, "data")
        labels = timeline.labels
        labels[labels == -1] = CATEGORIES.index("overhead")
        spent.totals += np.bincount(labels, minlength=len(CATEGORIES))[: len(CATEGORIES)] * (
            timeline.width
        )
        selves = _self_times(mine, run.device_events, step, run.on_device, kinds)
        for name, seconds, category in selves:
            spent.op_self[name] += seconds
            spent.op_category[name] = category
    return spent


def _breakdown(totals: npt.NDArray[np.float64]) -> dict[str, float]:
    """Each category's share of the steps' time."""
    total = totals.sum() or 1.0
    return {name: float(totals[i] / total) for i, name in enumerate(CATEGORIES)}


def _device_notes(run: _Run) -> list[str]:
    """A note when the trace lacks the device's activity of a run that had one (or may
    have had: a GPU listed), since the shares are then the host's."""
    if run.cuda_run and not run.on_device:
        return [
            "a CUDA run profiled without the device's activity (no kernels in the trace): "
            "the shares are the host's, whose kernel launches return at once, so compute "
            "looks cheaper and the loop dearer than they are; profile with "
            "ProfilerActivity.CUDA (ProfilerSchedule does) for where the device's time goes"
        ]
    if run.gpu_listed and not run.on_device:
        return [
            "the trace lists a GPU but recorded no device activity: read as a CPU run. If "
            "this run trained on the GPU, profile with ProfilerActivity.CUDA (ProfilerSchedule "
            "does): without it the shares are the host's and the fixes a CPU's"
        ]
    return []


def _with_unprofiled_data_share(
    breakdown: dict[str, float], unprofiled: float
) -> tuple[dict[str, float], str]:
    """A CPU trace's breakdown with ``data`` the share measured on un-profiled steps (the
    profiler slows a Python loader more than the model) and the rest scaled to fit."""
    traced, true = breakdown["data"], min(max(unprofiled, 0.0), 1.0)
    scale = (1.0 - true) / (1.0 - traced) if traced < 1.0 else 0.0
    breakdown = {k: (true if k == "data" else v * scale) for k, v in breakdown.items()}
    note = (
        f"data wait is {true:.1%} of the step as measured on unprofiled steps "
        f"({traced:.1%} in the trace, where the profiler slows the Python loader); "
        "the other shares are scaled to fit"
    )
    return breakdown, note


def _with_unprofiled_step(
    breakdown: dict[str, float], step_ms: float, unprofiled_step_ms: float
) -> tuple[dict[str, float], float, str]:
    """A device trace's breakdown and step time with the device's idle time taken as what
    the un-profiled step leaves. Kernels run as fast under the profiler; the host does
    not, and the device idles for it: the kernels' time is kept."""
    spent = {k: v * step_ms for k, v in breakdown.items()}
    busy = sum(v for k, v in spent.items() if k != "overhead")
    spent["overhead"] = max(unprofiled_step_ms - busy, 0.0)
    total = sum(spent.values())
    note = (
        f"profiled steps took {step_ms:.1f} ms, un-profiled ones {unprofiled_step_ms:.1f} "
        f"ms: the profiler slows the host, so the device's idle time is taken as what "
        f"the un-profiled step leaves ({spent['overhead']:.1f} ms)"
    )
    return {k: v / total for k, v in spent.items()}, total, note


def _top_ops(spent: _Spent, n: int, step_ms: float) -> list[dict[str, Any]]:
    """The ten operators with the most self time, per step and as a share of it."""
    top = sorted(spent.op_self.items(), key=lambda kv: -kv[1])[:10]
    return [
        {
            "name": name,
            "category": spent.op_category[name],
            "ms_per_step": us / n / 1e3,
            "share": us / n / 1e3 / step_ms,
        }
        for name, us in top
    ]


def _unfused_attention(run: _Run) -> bool:
    """Whether attention ran unfused: a softmax on the host (not a loss's log-softmax), no
    fused attention anywhere."""
    softmax = (e for e in run.host if not _has(e.name, _LOSS_SOFTMAX))
    return any(_has(e.name, ("softmax",)) for e in softmax) and not any(
        _has(e.name, _FUSED_ATTENTION) for e in run.host + run.device_events
    )
