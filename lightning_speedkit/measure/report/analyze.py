"""``analyze_trace``: a trace in, a :class:`Report` out.

It reads the trace (:mod:`.trace`), lays each step on a timeline (:mod:`.timeline`,
names grouped by :mod:`.kernels`), finds the sync call sites (:mod:`.sources`), and
runs the diagnosis's rules (:mod:`.rules`) on what it measured.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lightning_speedkit.measure.report.kernels import (
    _COMM,
    _FUSED_ATTENTION,
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
from lightning_speedkit.measure.report.trace import _events, _memory, load_trace


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
    events = sorted(_events(data), key=lambda e: e.start)
    steps, main = _steps(events)
    device_events = [e for e in events if e.cat in ("kernel", "gpu_memcpy", "gpu_memset")]
    on_device = bool(device_events)
    # A CUDA run whose kernels the trace lacks still shows its launches (CUDA runtime
    # calls): its fixes are a GPU's. A listed GPU alone says nothing of the run (torch
    # lists the machine's GPUs in a CPU run's trace too): a note, not the advice.
    cuda_run = on_device or any(e.cat in ("cuda_runtime", "cuda_driver") for e in events)
    gpu_listed = bool(data.get("deviceProperties"))
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
    if cuda_run and not on_device:
        notes.append(
            "a CUDA run profiled without the device's activity (no kernels in the trace): "
            "the shares are the host's, whose kernel launches return at once, so compute "
            "looks cheaper and the loop dearer than they are; profile with "
            "ProfilerActivity.CUDA (ProfilerSchedule does) for where the device's time goes"
        )
    elif gpu_listed and not on_device:
        notes.append(
            "the trace lists a GPU but recorded no device activity: read as a CPU run. If "
            "this run trained on the GPU, profile with ProfilerActivity.CUDA (ProfilerSchedule "
            "does): without it the shares are the host's and the fixes a CPU's"
        )
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
    evidence = Evidence(
        breakdown, modules, sites, memory_info, unfused, step_ms, top_ops, on_device, cuda_run
    )
    findings = _diagnose(evidence)
    return Report(
        source=source,
        device="cuda" if cuda_run else "cpu",
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
