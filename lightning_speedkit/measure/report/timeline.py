"""Where a step's time goes: each step as a timeline of :data:`BINS_PER_STEP` bins, each
bin labelled with one of :data:`CATEGORIES` (host operators on a CPU-only trace, kernels
and the host's idle reasons on a device trace); the operators' self times; the top-level
modules' shares of forward time.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from lightning_speedkit.errors import SpeedkitConfigError
from lightning_speedkit.measure.report.kernels import _SYNC_RUNTIME, _category, _short_kernel_name
from lightning_speedkit.measure.report.trace import _Event

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
BINS_PER_STEP = 20_000  #: timeline resolution

_T = TypeVar("_T")

_DATA_REGIONS = ("speedkit/data_fetch", "train_dataloader_next", "enumerate(DataLoader)")


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


#: ProfilerSchedule's marks of a recorded step that is no training step.
_NOT_A_STEP = ("speedkit/validation", "speedkit/aborted")


def _steps(events: list[_Event]) -> tuple[list[_Event], Any]:
    # The host's ranges: CUDA traces mirror each on the device's timeline
    # (``gpu_user_annotation``, device clock), which is not where a step is.
    host = [e for e in events if e.cat != "gpu_user_annotation"]
    steps = sorted((e for e in host if e.name.startswith("ProfilerStep#")), key=lambda e: e.start)
    # ProfilerSchedule marks each step's forward, Lightning's PyTorchProfiler the
    # strategy's training_step. A window that training ends (or a run that stops) cuts
    # short keeps torch's last ProfilerStep range, opened for a step that never ran (with
    # Lightning's profiler: the last backward and the fit's teardown): a step without a
    # forward where the others have one is not a step. Nor is one that ran validation or
    # that an exception ended (ProfilerSchedule marks both).
    forwards = sorted(e.start for e in host if _is_forward(e.name))
    if forwards:
        ran = [s for s in steps if _inside(forwards, forwards, s.start, s.end)]
        steps = ran or steps
    other = sorted(e.start for e in host if e.name in _NOT_A_STEP)
    if other:
        steps = [s for s in steps if not _inside(other, other, s.start, s.end)] or steps
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


def _is_forward(name: str) -> bool:
    """A step's forward: ProfilerSchedule's mark, or Lightning's profiled
    ``[Strategy]<Strategy>.training_step`` (recent versions put ``[pl][profile]`` before it)."""
    return name == "speedkit/forward" or ("[Strategy]" in name and name.endswith(".training_step"))


def _inside(items: list[_T], starts: list[float], start: float, end: float) -> list[_T]:
    """The items that start within [start, end): ``items`` sorted by start, ``starts``
    their starts. Given a sorted list of starts as both, the starts within (empty: none)."""
    lo, hi = bisect.bisect_left(starts, start), bisect.bisect_left(starts, end)
    return items[lo:hi]


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
    """The module names whose shares the report gives (see :func:`_module_rows`)."""
    return set(_module_rows(names).values())


def _module_rows(names: set[str]) -> dict[str, str]:
    """Of the modules marked at every depth, those that are counted, each with its row.

    Lightning's PyTorchProfiler marks every module that is called (``model``,
    ``model.vision``, ``model.vision.blocks.0``, ...). As ProfilerSchedule does, the rows
    are the LightningModule's children, or while there is a single one with children of
    its own (``self.model``), its children: one depth only, so that no time is counted
    twice. A row missing from the names is a container that is never called itself (an
    ``nn.ModuleList`` of blocks, an ``nn.ModuleDict``): its shallowest marked descendants
    (``blocks.0``, ``blocks.1``, ...) are counted in it.
    """
    nodes = set(names)
    for name in names:
        parts = name.split(".")
        nodes.update(".".join(parts[:depth]) for depth in range(1, len(parts)))

    def children(node: str) -> set[str]:
        return {n for n in nodes if n.rpartition(".")[0] == node}

    level = children("")
    while len(level) == 1 and children(next(iter(level))):
        level = children(next(iter(level)))
    rows = {}
    for name in names:
        parts = name.split(".")
        prefixes = [".".join(parts[:depth]) for depth in range(1, len(parts) + 1)]
        row = next((p for p in prefixes if p in level), None)
        if row is None:
            continue  # above the rows' depth
        below = prefixes[prefixes.index(row) : -1]
        if not any(p in names for p in below):  # its own time, not inside a counted module
            rows[name] = row
    return rows


def _module_shares(
    host: list[_Event], kernels: list[_Event], launches: Mapping[Any, _Event], on_device: bool
) -> dict[str, float]:
    regions = [(name, e) for e in host if (name := _module_name(e.name)) is not None]
    if any(e.name.startswith("[pl][module]") for _, e in regions):
        rows = _module_rows({name for name, _ in regions})
        regions = [(rows[name], e) for name, e in regions if name in rows]
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
