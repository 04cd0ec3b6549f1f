"""Host-device sync call sites: the Python line that made each sync, from the trace's
Python stacks and, since a profiler records a function's first line, from the source of
that function (the ``.item()``, ``.cpu()`` or ``.tolist()`` line in its body). A sync
made inside torch, Lightning or the kit is named but not blamed on the user's code.
"""

from __future__ import annotations

import ast
import bisect
import re
import sys
import tokenize
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_speedkit.measure.report.kernels import _SYNC_RUNTIME
from lightning_speedkit.measure.report.trace import _Event

_LIBRARY_FRAMES = re.compile(
    r"(^|/)(torch|lightning|pytorch_lightning|lightning_fabric|lightning_utilities|"
    r"lightning_speedkit|torchmetrics|deepspeed|transformers|timm|numpy)/|^<frozen "
)
_FRAME = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<func>.+)$")
_SYNC_CALLS = re.compile(r"\.(item|cpu|tolist|numpy)\(|torch\.cuda\.synchronize|\.to\([\"']cpu")


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
            with tokenize.open(path) as handle:  # the source's own encoding, not the locale's
                source = handle.read()
        except (OSError, SyntaxError, UnicodeDecodeError):  # SyntaxError: a bad coding line
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
