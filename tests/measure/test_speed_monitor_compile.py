"""SpeedMonitor beside compiled blocks and ProfilerSchedule: the FLOP count leaves both alone.

A FLOP count runs the step under a dispatch mode, where RegionalCompile's blocks run
eagerly. Counted on the first step, that step compiled nothing, ProfilerSchedule took it
for a step past compilation and opened its window on the step that really compiled.
Asserted on counts of compilations per step, never on time.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_speedkit import ProfilerSchedule, RegionalCompile, SpeedMonitor, _compat
from lightning_speedkit.measure._compile_watch import CompileWatch

from ..helpers.models import MLP, loader


class _Steps(L.Callback):
    """Per training step: graphs compiled, whether torch's profiler was on, FLOP counts done."""

    def __init__(self, monitor: SpeedMonitor) -> None:
        self.monitor = monitor
        self.watch = CompileWatch()
        self.compiled: list[int] = []
        self.profiled: list[bool] = []
        self.counted: list[int] = []
        self._before = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.watch.install()

    def on_train_batch_start(self, *args: Any) -> None:
        self._before = self.watch.compilations
        self.profiled.append(_compat.torch_profiler_enabled())

    def on_train_batch_end(self, *args: Any) -> None:
        self.compiled.append(self.watch.compilations - self._before)
        self.counted.append(len(self.monitor.flops.counted))

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        self.watch.remove()


def test_the_flop_count_waits_for_compilation_and_stays_out_of_profiled_steps(
    tmp_path: Path,
) -> None:
    torch._dynamo.reset()  # a fresh process's compile: this test counts graphs
    model = MLP(dim=16, hidden=32)
    monitor = SpeedMonitor(peak_flops=1e12, warmup_steps=0)
    profiler = ProfilerSchedule(wait=0, warmup=0, active=2, dirpath=tmp_path, with_stack=False)
    steps = _Steps(monitor)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=8, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[RegionalCompile(blocks=[torch.nn.Linear], backend="aot_eager",
                                   verbose=False), monitor, profiler, steps],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(n=128, dim=16, batch_size=8))
    said = [str(w.message) for w in caught if "during a profiled step" in str(w.message)]
    assert said == []  # ProfilerSchedule saw no compile in its window

    assert steps.compiled[0] > 0  # the first step ran the blocks compiled, and compiled them
    assert steps.compiled[1:] == [0] * 7
    # The window waited for the step that compiled (held one step) and one that did not.
    assert steps.profiled == [False, False, True, True, False, False, False, False]
    # Counted on the first step after a compile-free one that is not profiled: the fifth.
    assert steps.counted == [0, 0, 0, 0, 1, 1, 1, 1]
    assert monitor.summary["flops_per_sample"] == model.flops_per_sample()
