"""The report's host-device sync call sites: each named by the line that made the call,
from a real profile and from tiny traces of known frames. A trace records where a Python
function starts, not the line of each call, so the line comes from the function's source;
where the source cannot say which line, the site names the function and claims no line."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from lightning_speedkit.measure.report import analyze_trace


def two_syncs(x: torch.Tensor) -> float:
    # note to self: never call .cpu() or .tolist() in the hot loop
    total = (x * 2).sum()
    first = total.item()  # the first sync
    second = x.mean().item()
    return first + second


def looped_syncs(xs: torch.Tensor) -> list[float]:
    out = []
    for x in xs:
        out.append(x.sum().item())
    out.append(xs[0].mean().item())
    return out


def line_of(fn: Callable[..., Any], text: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def profiled(fn: Callable[..., Any], tmp_path: Path) -> list[dict[str, Any]]:
    """The sync sites of three steps of ``fn`` profiled with Python stacks."""
    trace = tmp_path / "trace.json"
    with profile(
        activities=[ProfilerActivity.CPU],
        with_stack=True,
        schedule=schedule(wait=0, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace)),
    ) as prof:
        for _ in range(4):
            fn(torch.randn(2, 8))
            prof.step()
    report = analyze_trace(trace)
    assert report.steps == 3
    return [s for s in report.sync_sites if s["user_code"]]


def test_two_syncs_in_one_function_are_two_sites_on_their_own_lines(tmp_path: Path) -> None:
    """Not the comment that mentions .cpu(), not the first .item() for both: each line."""
    sites = sorted(profiled(two_syncs, tmp_path), key=lambda s: s["site"])
    assert len(sites) == 2
    first, second = line_of(two_syncs, "total.item()"), line_of(two_syncs, "x.mean().item()")
    assert sites[0]["site"].endswith(
        f"test_report_sync_sites.py:{first} in two_syncs: first = total.item()"
    )
    assert sites[1]["site"].endswith(
        f"test_report_sync_sites.py:{second} in two_syncs: second = x.mean().item()"
    )
    assert [s["per_step"] for s in sites] == [1.0, 1.0]


def test_syncs_a_loop_makes_name_the_function_and_its_candidate_lines(tmp_path: Path) -> None:
    """Three item() calls a step from two lines, one of them in a loop: which call was
    which is not in the trace, so no line is claimed."""
    (site,) = profiled(looped_syncs, tmp_path)
    inner, after = line_of(looped_syncs, "x.sum().item()"), line_of(looped_syncs, "xs[0]")
    assert site["site"].endswith(
        f"test_report_sync_sites.py in looped_syncs, its item() on line {inner} or {after} "
        "(the trace names the function, not the line)"
    )
    assert site["per_step"] == 3.0


def _x(name: str, cat: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": 1,
            "args": args}  # fmt: skip


def frame_trace(frame: str, calls: list[str], syncs: list[int]) -> dict[str, Any]:
    """One 1000 us step in which the Python frame ``frame`` (id 1) calls the built-ins
    ``calls`` in turn, 100 us apart; those at the indices ``syncs`` read a scalar."""
    events = [
        _x("ProfilerStep#0", "user_annotation", 0, 1000),
        _x(frame, "python_function", 10, 900, **{"Python id": 1, "Python parent id": None}),
    ]
    for i, call in enumerate(calls):
        t = 100 + 100 * i
        ids = {"Python id": 10 + i, "Python parent id": 1}
        events.append(_x(call, "python_function", t, 50, **ids))
        if i in syncs:
            events.append(_x("aten::_local_scalar_dense", "cpu_op", t + 10, 20))
    return {"traceEvents": events}


ITEM = "<built-in method item of Tensor object at 0x7f0>"
APPEND = "<built-in method append of list object at 0x7f1>"
SOURCE = """\
import torch

def training_step(batch):
    # remember: .cpu() and .item() sync the device
    loss = batch.sum()
    a = loss.item()
    log = [a]
    log.append(
        batch.mean()
        .item()
    )
    return loss
"""


@pytest.mark.parametrize(
    ("syncs", "expected"),
    [
        ([0], ["{path}:6 in training_step: a = loss.item()"]),
        ([2], ["{path}:10 in training_step: .item()"]),  # the line the call's name is on
        (
            [0, 2],
            ["{path}:6 in training_step: a = loss.item()", "{path}:10 in training_step: .item()"],
        ),
    ],
)
def test_a_frames_calls_in_turn_name_each_syncs_line(
    tmp_path: Path, syncs: list[int], expected: list[str]
) -> None:
    path = tmp_path / "user_module.py"
    path.write_text(SOURCE)
    trace = frame_trace(f"{path}(3): training_step", [ITEM, APPEND, ITEM], syncs)
    sites = analyze_trace(trace).sync_sites
    assert sorted(s["site"] for s in sites) == sorted(e.format(path=path) for e in expected)
    assert all(s["user_code"] for s in sites)


def test_without_the_source_the_site_is_the_function_not_a_line(tmp_path: Path) -> None:
    trace = frame_trace(f"{tmp_path}/gone.py(3): training_step", [ITEM], [0])
    (site,) = analyze_trace(trace).sync_sites
    assert site["site"] == (
        f"{tmp_path}/gone.py in training_step, its item() call "
        "(the trace names the function, not the line)"
    )


def test_a_sync_with_no_call_recorded_names_only_the_function(tmp_path: Path) -> None:
    """``float(loss)`` or ``if loss:`` read a scalar without a built-in call in the trace:
    the frame's first line is not the sync's, so none is claimed."""
    path = tmp_path / "user_module.py"
    path.write_text(SOURCE)
    trace = frame_trace(f"{path}(3): training_step", [], [])
    trace["traceEvents"].append(_x("aten::_local_scalar_dense", "cpu_op", 500, 20))
    (site,) = analyze_trace(trace).sync_sites
    assert site["site"] == f"{path} in training_step (the trace names the function, not the line)"


def test_a_frame_running_before_the_profiler_started_is_not_read_by_turn(
    tmp_path: Path,
) -> None:
    """A frame already running when the profiler started is recorded at the line it
    stood on then, and its earlier calls are missing: two item() lines stay two
    candidates."""
    path = tmp_path / "user_module.py"
    path.write_text(SOURCE)
    trace = frame_trace(f"{path}(7): training_step", [ITEM], [0])
    (site,) = analyze_trace(trace).sync_sites
    assert site["site"] == (
        f"{path} in training_step, its item() on line 6 or 10 "
        "(the trace names the function, not the line)"
    )


def test_a_sync_site_is_read_in_its_sources_own_encoding(tmp_path: Path) -> None:
    """A user's module declared latin-1 (PEP 263), non-ASCII in a comment: the report
    still quotes the line with the sync, whatever the locale's encoding."""
    source = (
        "# -*- coding: latin-1 -*-\n"
        "def training_step(batch):\n"
        "    # m\xe9trique\n"
        "    return batch.sum().item()\n"
    )
    path = tmp_path / "user_module.py"
    path.write_bytes(source.encode("latin-1"))
    trace = frame_trace(f"{path}(2): training_step", [ITEM], [0])
    (site,) = analyze_trace(json.loads(json.dumps(trace))).sync_sites
    assert site["site"] == f"{path}:4 in training_step: return batch.sum().item()"
