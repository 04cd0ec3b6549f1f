"""analyze_trace's named steps, each on exact inputs."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from lightning_speedkit.measure.report.analyze import (
    _breakdown,
    _device_notes,
    _Run,
    _sort_events,
    _Spent,
    _top_ops,
    _unfused_attention,
    _with_unprofiled_data_share,
    _with_unprofiled_step,
)
from lightning_speedkit.measure.report.timeline import CATEGORIES


def _x(name: str, cat: str, ts: float, dur: float, tid: int = 1) -> dict[str, object]:
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_events_are_sorted_by_what_they_are_read_for() -> None:
    run = _sort_events({"traceEvents": [
        _x("aten::softmax", "cpu_op", 20, 5),
        _x("ProfilerStep#1", "user_annotation", 0, 100),
        _x("gloo:all_reduce", "cpu_op", 30, 10, tid=2),
        _x("cudaLaunchKernel", "cuda_runtime", 40, 1),
    ], "deviceProperties": [{"id": 0}]})  # fmt: skip
    assert [e.name for e in run.steps] == ["ProfilerStep#1"]
    assert [e.name for e in run.host] == ["ProfilerStep#1", "aten::softmax", "cudaLaunchKernel"]
    assert [e.name for e in run.comm_other] == ["gloo:all_reduce"]
    assert (run.on_device, run.cuda_run, run.gpu_listed) == (False, True, True)
    assert _unfused_attention(run) is True
    (note,) = _device_notes(run)
    assert note.startswith("a CUDA run profiled without the device's activity")


def test_a_losss_log_softmax_is_no_attention() -> None:
    """Cross-entropy runs ``aten::_log_softmax`` (its CUDA kernels ``LogSoftMax...``): the
    report called it unfused attention, and advised AttentionSwap to a model without any."""
    from lightning_speedkit.measure.report.kernels import _category, _kernel_category

    run = _sort_events({"traceEvents": [
        _x("ProfilerStep#1", "user_annotation", 0, 100),
        _x("aten::log_softmax", "cpu_op", 20, 5),
        _x("aten::_log_softmax_backward_data", "cpu_op", 30, 5),
    ]})  # fmt: skip
    assert _unfused_attention(run) is False
    assert _category("aten::_log_softmax") == "elementwise"
    assert _category("aten::_softmax") == "attention"  # eager attention's, as before
    from lightning_speedkit.measure.report.trace import _Event

    kernel = _Event("softmax_warp_forward<float, float, float, 8, true>", "kernel", 20, 25, 1,
                    {"External id": 7})  # fmt: skip
    loss = _Event("aten::_log_softmax", "cpu_op", 20, 25, 1, {"External id": 7})
    assert _kernel_category(kernel, {7: loss}) == "elementwise"


def test_a_cpu_run_on_a_gpu_machine_is_read_as_a_cpu_run() -> None:
    run = _Run([], [], [], [], [], {}, on_device=False, cuda_run=False, gpu_listed=True)
    (note,) = _device_notes(run)
    assert note.startswith("the trace lists a GPU but recorded no device activity")
    assert _device_notes(_Run([], [], [], [], [], {}, False, False, False)) == []


def test_the_breakdown_is_each_categorys_share() -> None:
    totals = np.zeros(len(CATEGORIES))
    totals[CATEGORIES.index("data")], totals[CATEGORIES.index("matmul")] = 1.0, 3.0
    breakdown = _breakdown(totals)
    assert list(breakdown) == list(CATEGORIES)
    assert (breakdown["data"], breakdown["matmul"], sum(breakdown.values())) == (0.25, 0.75, 1.0)


def test_the_unprofiled_data_share_replaces_the_traced_one() -> None:
    breakdown = {"data": 0.5, "matmul": 0.25, "overhead": 0.25}
    taken, note = _with_unprofiled_data_share(breakdown, 0.2)
    assert taken == {"data": 0.2, "matmul": pytest.approx(0.4), "overhead": pytest.approx(0.4)}
    assert note.startswith("data wait is 20.0% of the step as measured on unprofiled steps "
                           "(50.0% in the trace")  # fmt: skip
    assert _with_unprofiled_data_share(breakdown, 1.5)[0]["data"] == 1.0  # at most the step


def test_the_unprofiled_step_leaves_the_devices_idle_time() -> None:
    # a 10 ms profiled step: 4 ms of matmul, 6 ms idle; un-profiled, the step takes 5 ms
    breakdown = {"matmul": 0.4, "overhead": 0.6}
    taken, step_ms, note = _with_unprofiled_step(breakdown, 10.0, 5.0)
    assert step_ms == 5.0
    assert taken == {"matmul": pytest.approx(0.8), "overhead": pytest.approx(0.2)}
    assert note == ("profiled steps took 10.0 ms, un-profiled ones 5.0 ms: the profiler "
                    "slows the host, so the device's idle time is taken as what the "
                    "un-profiled step leaves (1.0 ms)")  # fmt: skip


def test_the_top_operators_per_step() -> None:
    op_self = defaultdict(float, {f"op{i}": float(i) * 1e3 for i in range(12)})
    spent = _Spent(np.zeros(len(CATEGORIES)), op_self, {f"op{i}": "matmul" for i in range(12)},
                   step_time=0.0)  # fmt: skip
    top = _top_ops(spent, n=2, step_ms=10.0)
    assert [row["name"] for row in top] == [f"op{i}" for i in range(11, 1, -1)]
    assert top[0] == {"name": "op11", "category": "matmul", "ms_per_step": 5.5, "share": 0.55}
