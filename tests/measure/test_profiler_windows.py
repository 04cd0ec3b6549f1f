"""WindowRunner without a Trainer: a profiler only in the windows, failures said once."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_speedkit.measure._profiler_cycle import ProfilerCycle
from lightning_speedkit.measure._profiler_hold import CompileHold
from lightning_speedkit.measure._profiler_marks import StepMarks
from lightning_speedkit.measure._profiler_traces import TraceStore


class Watch:
    compilations = 0

    def install(self) -> Watch:
        return self

    def remove(self) -> None:
        pass


def runner(cycle: ProfilerCycle, watch: Watch | None = None) -> Any:
    from lightning_speedkit.measure._profiler_windows import WindowRunner

    return WindowRunner(cycle, marks=StepMarks(), hold=CompileHold(watch or Watch()))


def train(run: Any, steps: int, watch: Watch | None = None, compiles: dict[int, int] | None = None
          ) -> list[int]:  # fmt: skip
    """Run ``steps`` steps (step s compiles ``compiles[s]`` graphs); the steps a profiler
    existed for."""
    profiled = []
    for step in range(steps):
        if run.profiler is not None:
            profiled.append(step)
        torch.ones(2) * 2
        if watch is not None and compiles:
            watch.compilations += compiles.get(step, 0)
        run.step_ends()
    return profiled


def start(run: Any, tmp_path: Path, analysed: list[str] | None = None,
          compiled_parts: bool = False) -> TraceStore:  # fmt: skip
    store = TraceStore(tmp_path, rank=0, max_trace_mb=100.0, keep=5)
    record = (lambda raw, path: analysed.append(path.name)) if analysed is not None else (
        lambda raw, path: None)  # fmt: skip
    run.reset(None)
    run.start(store, analyse=record, compiled_parts=compiled_parts)
    return store


def test_a_profiler_exists_only_in_the_windows(tmp_path: Path) -> None:
    run = runner(ProfilerCycle(skip_first=2, wait=1, warmup=1, active=2, repeat=2))
    analysed: list[str] = []
    store = start(run, tmp_path, analysed)
    assert train(run, 12) == [3, 4, 5, 7, 8, 9]
    run.finish()
    assert analysed == ["rank0-window0.pt.trace.json.gz", "rank0-window1.pt.trace.json.gz"]
    assert [p.name for p in store.traces] == analysed
    assert (run.steps, run.windows, run.delay, run.written) == (12, 2, 0, 2)


def test_a_held_window_moves_the_schedule_later(tmp_path: Path) -> None:
    watch = Watch()
    run = runner(ProfilerCycle(skip_first=0, wait=0, warmup=1, active=2, repeat=1), watch)
    start(run, tmp_path, compiled_parts=True)
    # steps 0 and 1 compile; step 2 compiles nothing: the window opens at step 3
    assert train(run, 8, watch, compiles={0: 2, 1: 1}) == [3, 4, 5]
    assert (run.windows, run.delay) == (1, 3)


def test_a_resumed_run_goes_on_with_its_schedule(tmp_path: Path) -> None:
    run = runner(ProfilerCycle(skip_first=0, wait=2, warmup=0, active=1, repeat=0))
    store = TraceStore(tmp_path, rank=0, max_trace_mb=100.0, keep=5)
    run.reset((4, 1, 0))  # the checkpoint's steps, windows, delay
    run.start(store, analyse=lambda raw, path: None, compiled_parts=False)
    assert train(run, 6) == [1, 4]  # absolute steps 5 and 8
    assert (run.steps, run.windows) == (10, 3)


def test_a_run_that_ends_before_its_window_says_so(tmp_path: Path) -> None:
    run = runner(ProfilerCycle(skip_first=10, wait=1, warmup=1, active=3, repeat=1))
    start(run, tmp_path)
    train(run, 8)
    with pytest.warns(UserWarning, match=r"ran 8 batches.* = 10 \+ 1 \+ 1 \+ 3 = 15 batches"):
        run.finish()


def test_a_resume_whose_windows_are_all_behind_it_says_so(tmp_path: Path) -> None:
    """The checkpoint of a run that took 1 window (skip_first=2, wait=1, active=2) by
    batch 24, resumed with 3 cycles of 3 batches: all end by batch 9."""
    run = runner(ProfilerCycle(skip_first=0, wait=1, warmup=1, active=1, repeat=3))
    run.reset((24, 1, 0))
    run.start(TraceStore(tmp_path, rank=0, max_trace_mb=100.0, keep=5),
              analyse=lambda raw, path: None, compiled_parts=False)  # fmt: skip
    assert train(run, 12) == []
    with pytest.warns(UserWarning, match="recorded nothing") as record:
        run.finish()
    (message,) = [str(w.message) for w in record]
    assert message.startswith(
        "ProfilerSchedule recorded nothing: this run resumed after 24 batches and trained "
        "12 more, but the schedule's 3 windows (`repeat=3`) all fall in the first "
    )
    assert "Set `repeat=0` (a window every cycle until training ends) or `repeat=9`" in message


def test_a_resume_whose_windows_the_run_before_took_says_nothing(tmp_path: Path) -> None:
    run = runner(ProfilerCycle(skip_first=0, wait=1, warmup=1, active=1, repeat=3))
    run.reset((24, 3, 0))
    run.start(TraceStore(tmp_path, rank=0, max_trace_mb=100.0, keep=5),
              analyse=lambda raw, path: None, compiled_parts=False)  # fmt: skip
    assert train(run, 12) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run.finish()


def test_a_window_over_the_cap_is_not_said_to_be_recorded_nothing(tmp_path: Path) -> None:
    run = runner(ProfilerCycle(skip_first=0, wait=0, warmup=0, active=1, repeat=0))
    run.reset(None)
    run.start(TraceStore(tmp_path, rank=0, max_trace_mb=1e-9, keep=5),
              analyse=lambda raw, path: None, compiled_parts=False)  # fmt: skip
    with pytest.warns(UserWarning, match="over max_trace_mb"):
        train(run, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run.finish()  # the cap was said; "training ran 2 batches, ... needed 1" is false
    assert (run.windows, run.written) == (2, 0)


def test_a_window_cut_short_in_its_warm_up_is_not_written(tmp_path: Path) -> None:
    run = runner(ProfilerCycle(skip_first=0, wait=0, warmup=2, active=1, repeat=1))
    start(run, tmp_path)
    train(run, 1)  # ends in the warm-up
    assert run.profiler is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run.end_window()
    assert (run.profiler, run.disabled) == (None, True)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_gives_up_once_after_torchs_step_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = runner(ProfilerCycle(skip_first=0, wait=0, warmup=0, active=1, repeat=0))
    store = start(run, tmp_path)
    (tmp_path / "x").write_text("")
    store.directory = tmp_path / "x"  # the directory is now a file
    with pytest.warns(UserWarning, match="training goes on without profiling") as record:
        profiled = train(run, 4)
    assert profiled == [0]  # stopped at once, nothing more made
    messages = [str(w.message) for w in record if "ProfilerSchedule" in str(w.message)]
    assert messages == [f"ProfilerSchedule: writing a trace failed (the directory "
                        f"{tmp_path / 'x'} is now a file); training goes on without "
                        f"profiling."]  # fmt: skip
    assert (run.disabled, run.profiler, run.failure) == (True, None, None)
    assert (run.windows, run.written) == (1, 0)


def test_warn_once_is_once_per_fit(tmp_path: Path) -> None:
    run = runner(ProfilerCycle(skip_first=0, wait=0, warmup=0, active=1, repeat=1))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run.warn_once("cap", "over the cap")
        run.warn_once("cap", "over the cap")
        run.reset(None)  # a new fit
        run.warn_once("cap", "over the cap")
    assert [str(w.message) for w in record] == ["over the cap", "over the cap"]
