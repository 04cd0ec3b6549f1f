"""A profiled window's report: its trace analysed with what the run measured beside it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_speedkit.measure.report import Report, amend_for_callbacks, analyze_trace

__all__ = ["analyse_window", "device_memory", "report_window"]


def device_memory(device: torch.device) -> tuple[float, float] | None:
    """``(peak reserved bytes, device bytes)`` of a CUDA device; ``None`` elsewhere."""
    if device.type != "cuda":
        return None
    capacity = torch.cuda.get_device_properties(device).total_memory
    return float(torch.cuda.max_memory_reserved(device)), float(capacity)


def report_window(
    raw: Path,
    *,
    source: str,
    directory: Path,
    rank: int,
    memory: tuple[float, float] | None,
    unprofiled: tuple[float | None, float | None],
    callbacks: Sequence[str],
    analyze: Callable[..., Report] = analyze_trace,
) -> tuple[Report, list[Path]]:
    """Analyse the trace ``raw`` and write its report beside the traces.

    Args:
        raw: the window's chrome trace (JSON).
        source: the name the report gives the trace.
        directory: where ``speedkit_report.*`` go (ranks other than 0 add ``-rank<R>``).
        rank: the process's global rank.
        memory: see :func:`device_memory`.
        unprofiled: the un-profiled steps' median data-wait share and step milliseconds
            (:meth:`~lightning_speedkit.measure._profiler_timings.UnprofiledTimings.medians`).
        callbacks: the class names of the Trainer's callbacks (a fix the run already
            has is not advised).
        analyze: what reads the trace (:func:`~lightning_speedkit.measure.report.analyze_trace`).

    Returns:
        The report and its markdown, JSON and PNG files.
    """
    share, step_ms = unprofiled
    report = analyze(
        raw,
        memory=memory,
        source=source,
        unprofiled_data_share=share,
        unprofiled_step_ms=step_ms,
    )
    amend_for_callbacks(report, callbacks)
    stem = "speedkit_report" if rank == 0 else f"speedkit_report-rank{rank}"
    return report, report.write(directory, stem)


def analyse_window(
    raw: Path,
    path: Path,
    *,
    rank: int,
    device: torch.device,
    warn_once: Callable[[str, str], None],
    **context: Any,
) -> tuple[Report, list[Path]] | None:
    """:func:`report_window` for the trace kept at ``path``, said on rank 0; a failure
    costs only the report: said once (``warn_once(key, message)``), and ``None``.

    ``device``: the accelerator (its memory figures: :func:`device_memory`);
    ``context``: :func:`report_window`'s ``unprofiled``, ``callbacks`` and ``analyze``.
    """
    try:
        report, files = report_window(raw, source=path.name, directory=path.parent, rank=rank,
                                      memory=device_memory(device), **context)  # fmt: skip
    except Exception as error:
        why = f"{type(error).__name__}: {error}"
        warn_once("report", f"ProfilerSchedule: the report of {path.name} failed ({why}); "
                            f"traces are still written.")  # fmt: skip
        return None
    if rank == 0:
        kinds = ", ".join(report.kinds) or "nothing stands out"
        rank_zero_info(f"ProfilerSchedule: {kinds}; report in {files[0]}")
    return report, files
