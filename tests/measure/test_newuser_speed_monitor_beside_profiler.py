"""SpeedMonitor beside ProfilerSchedule, as the README adds them: the profiled window's
steps and the writing of its trace are not training's speed.

Profiled steps run slower, and the window's trace is written and analysed (seconds) in
ProfilerSchedule's batch-end hook. SpeedMonitor timed both: its next step's data wait held
the analysis. In the README's 40-step run on 2 CPU cores, samples/s read 3,444 against
26,190 without the profiler, data wait 85% against 24%, p99 step 285 ms against 1.4 ms.
Here on a virtual clock: a 20 ms step, a profiled step 500 ms, the analysis 5 s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_speedkit import ProfilerSchedule, SpeedMonitor
from lightning_speedkit.measure import _clock
from lightning_speedkit.measure._profiler_windows import window_open

from ..helpers import models
from ..helpers.clock import VirtualClock
from ..helpers.models import MLP, loader

STEP, PROFILED, ANALYSIS = 0.02, 0.5, 5.0


class ProfiledSlower(MLP):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        models._sleep(PROFILED if window_open() else STEP)
        return super().training_step(batch, batch_idx)


@pytest.fixture
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    clock = VirtualClock()
    monkeypatch.setattr(_clock, "_host_time", clock)
    monkeypatch.setattr(models, "_sleep", clock.sleep)
    analyse = ProfilerSchedule._analyse

    def slow_analysis(self: ProfilerSchedule, raw: Path, path: Path) -> None:
        clock.sleep(ANALYSIS)
        analyse(self, raw, path)

    monkeypatch.setattr(ProfilerSchedule, "_analyse", slow_analysis)
    return clock


@pytest.mark.parametrize("monitor_first", [True, False])
def test_the_window_and_its_trace_are_left_out_of_the_figures(
    monitor_first: bool, virtual_clock: VirtualClock, tmp_path: Path
) -> None:
    monitor = SpeedMonitor(peak_flops=None)
    profiler = ProfilerSchedule(wait=5, warmup=1, active=2, dirpath=tmp_path, with_stack=False)
    callbacks: list[Any] = [monitor, profiler] if monitor_first else [profiler, monitor]
    trainer = L.Trainer(
        accelerator="cpu", max_steps=20, logger=False, callbacks=callbacks,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(ProfiledSlower(), loader(n=160, batch_size=8))
    assert profiler.report is not None  # the window was profiled and analysed
    s = monitor.summary
    for key in ("step_ms_p50", "step_ms_p90", "step_ms_p99"):
        assert s[key] == pytest.approx(20.0), key
    assert s["data_wait_frac"] == 0.0
    assert s["samples_per_sec"] == pytest.approx(8 / STEP)
    assert not window_open()  # the fit's window is closed and written
