"""The throughput core on its own: exact figures from exact step times, no Trainer, no clock."""

from __future__ import annotations

import random

import pytest

from lightning_speedkit.measure._throughput import (
    FIELDS,
    StepTimes,
    Throughput,
    figures,
    percentile,
)


def _row(**fields: float) -> list[float]:
    return [float(fields.get(f, 0.0)) for f in FIELDS]


def test_one_rank_gives_rates_mfu_hfu_and_percentiles_exactly() -> None:
    throughput = Throughput(window=10)
    for tokens in (100, 300):
        throughput.update(samples=4, tokens=tokens, flops=(2e12, 3e12))
    row = throughput.close(step_times=[0.25, 0.75], waits=[0.05, 0.15], mem_gib=1.5)
    assert row == _row(samples=8, tokens=400, time=1.0, steps=2, model_flops=4e12,
                       hw_flops=6e12, wait=0.2, mem_gib=1.5)  # fmt: skip
    throughput.add([row])
    assert throughput.compute([row], peak=8e12, gpu_util=lambda: 0.5) == {
        "samples_per_sec": 8.0,
        "data_wait_frac": 0.2,
        "tokens_per_sec": 400.0,
        "tflops_per_device": 4.0,
        "mfu": 0.5,
        "hfu": 0.75,
        "flops_per_sample": 0.5e12,
        "step_ms_p50": 250.0,
        "step_ms_p90": 750.0,
        "step_ms_p99": 750.0,
        "mem_peak_gib": 1.5,
        "gpu_util": 0.5,
    }


def test_ranks_sum_their_rates_average_their_flops_and_name_the_straggler() -> None:
    fast = _row(samples=40, time=1.0, steps=10, model_flops=1e12, hw_flops=1e12)
    slow = _row(samples=40, time=2.0, steps=10, model_flops=1e12, hw_flops=1e12)
    third = _row(samples=40, time=1.0, steps=10, model_flops=1e12, hw_flops=1e12)
    got = figures([fast, slow, third], [], peak=None)
    assert got["samples_per_sec"] == 40 + 20 + 40
    assert got["tflops_per_device"] == pytest.approx((1 + 0.5 + 1) / 3)
    assert got["straggler_ratio"] == 0.2 / 0.1  # slowest mean step over the median
    assert "mfu" not in got  # no peak
    assert "step_ms_p50" not in got  # no step times


def test_a_rank_that_timed_nothing_gives_no_figures_and_unknowns_stay_out() -> None:
    assert figures([_row(samples=8, time=1.0), _row()], [0.1], peak=1e12) == {}
    only_samples = figures([_row(samples=8, time=2.0)], [], peak=1e12)
    assert only_samples == {"samples_per_sec": 4.0, "data_wait_frac": 0.0}


def test_the_run_adds_intervals_keeps_the_peak_memory_and_survives_a_checkpoint() -> None:
    throughput = Throughput(window=2)
    for step_s, memory in ((0.1, 2.0), (0.3, 1.0)):
        throughput.update(samples=4, tokens=None, flops=None)
        throughput.add([throughput.close(step_times=[step_s], waits=[0.0], mem_gib=memory)])
    throughput.update(samples=4, tokens=None, flops=None)
    throughput.add([throughput.close(step_times=[0.2], waits=[0.0], mem_gib=0.5)])
    assert throughput.run == [pytest.approx(_row(samples=12, time=0.6, steps=3, mem_gib=2.0))]
    assert list(throughput.recent) == [0.3, 0.2]  # the window's last two steps
    summary = throughput.summary(peak=None)
    assert summary["step_ms_p50"] == pytest.approx(200.0)
    assert summary["mem_peak_gib"] == 2.0

    restored = Throughput(window=2)
    restored.load_state_dict(throughput.state_dict())
    assert restored.summary(peak=None) == summary
    restored.reset()
    assert restored.summary(peak=None) == {}


@pytest.mark.parametrize(("q", "expected"), [(1, 1.0), (50, 2.0), (51, 3.0), (99, 4.0), (100, 4.0)])
def test_percentiles_are_nearest_rank(q: float, expected: float) -> None:
    assert percentile([3.0, 1.0, 4.0, 2.0], q) == expected


def test_a_new_fit_forgets_the_interval_a_fit_that_raised_left_unlogged() -> None:
    throughput = Throughput(window=4)
    for _ in range(5):  # five steps counted, never closed: the fit raised before its log
        throughput.update(samples=4, tokens=None, flops=(1.0, 1.0))
    throughput.reset()
    throughput.update(samples=4, tokens=None, flops=(1.0, 1.0))
    row = throughput.close(step_times=[0.5], waits=[0.0], mem_gib=0.0)
    assert row == pytest.approx(_row(samples=4, time=0.5, steps=1, model_flops=1.0, hw_flops=1.0))


def test_a_long_run_keeps_bounded_step_times_with_percentiles_within_half_a_percent() -> None:
    rng = random.Random(0)
    steps = [rng.lognormvariate(-2.0, 0.3) for _ in range(200_000)]  # ~135 ms, long tail
    throughput = Throughput(window=100)
    for start in range(0, len(steps), 50):  # log intervals of 50 steps
        throughput.update(samples=1, tokens=None, flops=None)
        throughput.add([throughput.close(step_times=steps[start : start + 50], waits=[0.0],
                                         mem_gib=0.0)])  # fmt: skip
    state = throughput.state_dict()["run_steps"]
    assert state["values"] == []
    assert len(state["buckets"]) < 1_000  # not 200,000 floats
    summary = throughput.summary(peak=None)
    for q in (50, 90, 99):
        exact = 1e3 * percentile(steps, q)
        assert abs(summary[f"step_ms_p{q}"] - exact) <= 0.005 * exact

    restored = Throughput(window=100)
    restored.load_state_dict(throughput.state_dict())
    assert restored.summary(peak=None) == summary
    assert len(restored.run_steps) == len(steps)


def test_step_times_stay_exact_up_to_the_limit_and_older_checkpoints_load() -> None:
    times = StepTimes([0.3, 0.1, 0.2], exact=3)
    assert times.percentiles((50, 100)) == {50: 0.2, 100: 0.3}  # exact at the limit
    assert not times.buckets
    older = Throughput(window=4)  # a checkpoint that kept every step time as a list
    older.load_state_dict({"run": [[4, 0, 0.6, 3, 0, 0, 0, 0]], "run_steps": [0.3, 0.1, 0.2]})
    assert older.summary(peak=None)["step_ms_p50"] == pytest.approx(200.0)


def test_the_straggler_is_the_rank_whose_compute_before_the_sync_is_longest() -> None:
    """Under DDP every rank's step ends in the all-reduce, which waits for the slowest:
    equal step times, and only the compute before it tells the ranks apart."""
    fast = _row(samples=40, time=1.0, steps=10, compute=0.2)
    slow = _row(samples=40, time=1.0, steps=10, compute=0.8)
    third = _row(samples=40, time=1.0, steps=10, compute=0.2)
    assert figures([fast, slow, third], [], peak=None)["straggler_ratio"] == 0.08 / 0.02
    # of two ranks, over the faster: the median averaged in the slow rank itself, so a
    # rank 4x slower read 1.6 and none could read 2 or more
    assert figures([fast, slow], [], peak=None)["straggler_ratio"] == 0.08 / 0.02
    unknown = _row(samples=40, time=1.0, steps=10)  # a rank that saw no backward: step times
    assert figures([fast, unknown], [], peak=None)["straggler_ratio"] == pytest.approx(1.0)


def test_a_checkpoints_rows_from_before_the_compute_field_load() -> None:
    throughput = Throughput(window=4)
    throughput.load_state_dict({"run": [[4, 0, 0.5, 2, 0, 0, 0, 0]], "run_steps": [0.25, 0.25]})
    assert throughput.run == [_row(samples=4, time=0.5, steps=2)]
    assert throughput.summary(peak=None)["samples_per_sec"] == 8.0
