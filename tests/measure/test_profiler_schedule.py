"""ProfilerSchedule: torch's schedule from Lightning hooks, marked phases, traces, never fatal."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torchmetrics.classification import MulticlassAccuracy

from lightning_speedkit import ProfilerSchedule, SpeedkitConfigError
from lightning_speedkit.measure.profiler_schedule import _top_level
from tests.helpers.models import MLP, loader


def fit(callback: ProfilerSchedule, steps: int) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback])  # fmt: skip
    trainer.fit(MLP(), loader(n=256))
    return trainer


REPORT = ["speedkit_report.json", "speedkit_report.md", "speedkit_report.png"]


def events(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path) as handle:
        trace: dict[str, Any] = json.load(handle)
    return list(trace["traceEvents"])


def count(trace: list[dict[str, Any]], name: str) -> int:
    return sum(1 for e in trace if e.get("name") == name and e.get("ph") == "X")


def test_windows_follow_the_schedule_and_mark_every_phase(tmp_path: Path) -> None:
    callback = ProfilerSchedule(skip_first=1, wait=1, warmup=1, active=2, repeat=2,
                                dirpath=tmp_path)  # fmt: skip
    fit(callback, steps=12)
    # two windows (repeat honoured), then nothing more although training went on
    assert [p.name for p in callback.traces] == [
        "rank0-window0.pt.trace.json.gz",
        "rank0-window1.pt.trace.json.gz",
    ]
    assert sorted(tmp_path.glob("*.pt.trace.json.gz")) == callback.traces
    assert sorted(p.name for p in tmp_path.glob("speedkit_report*")) == REPORT  # the latest
    for path in callback.traces:
        trace = events(path)
        steps = {e["name"] for e in trace if e.get("name", "").startswith("ProfilerStep#")}
        assert len(steps) == 2  # active=2 steps recorded per window
        for phase in ("forward", "backward", "optimizer_step", "module/net.0", "module/net.2"):
            assert count(trace, f"speedkit/{phase}") == 2, phase
        assert count(trace, "speedkit/data_fetch") >= 1


def test_repeat_zero_profiles_until_the_end_and_keeps_the_newest(tmp_path: Path) -> None:
    callback = ProfilerSchedule(skip_first=0, wait=0, warmup=1, active=1, repeat=0,
                                dirpath=tmp_path, num_traces_to_keep=2)  # fmt: skip
    fit(callback, steps=10)  # a window every two steps: five written, the last two kept
    assert [p.name for p in callback.traces] == [
        "rank0-window3.pt.trace.json.gz",
        "rank0-window4.pt.trace.json.gz",
    ]
    assert sorted(tmp_path.glob("*.pt.trace.json.gz")) == callback.traces


def test_a_trace_over_the_cap_is_dropped_with_one_warning(tmp_path: Path) -> None:
    callback = ProfilerSchedule(skip_first=0, wait=0, warmup=0, active=1, repeat=3,
                                dirpath=tmp_path, max_trace_mb=1e-6)  # fmt: skip
    with pytest.warns(UserWarning, match="over max_trace_mb") as record:
        trainer = fit(callback, steps=5)
    assert sum("over max_trace_mb" in str(w.message) for w in record) == 1
    assert callback.traces == []
    assert list(tmp_path.glob("*.pt.trace.json.gz")) == []  # the report of it stays
    assert trainer.global_step == 5


def test_an_unwritable_directory_does_not_stop_training(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    callback = ProfilerSchedule(skip_first=0, wait=0, warmup=0, active=1, dirpath=blocker / "x")
    with pytest.warns(UserWarning, match="training goes on without profiling"):
        trainer = fit(callback, steps=3)
    assert trainer.global_step == 3
    assert callback.traces == []


def test_a_profiler_error_warns_once_and_training_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Any) -> None:
        raise RuntimeError("kineto went away")

    monkeypatch.setattr(torch.profiler.profile, "step", broken)
    callback = ProfilerSchedule(skip_first=0, wait=0, warmup=0, active=1, dirpath=tmp_path)
    with pytest.warns(UserWarning, match="kineto went away") as record:
        trainer = fit(callback, steps=4)
    assert sum("kineto" in str(w.message) for w in record) == 1
    assert trainer.global_step == 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"active": 0}, "active"), ({"repeat": -1}, "repeat"), ({"wait": 1.5}, "wait"),
     ({"num_traces_to_keep": 0}, "num_traces_to_keep"), ({"max_trace_mb": 0}, "max_trace_mb")],
)  # fmt: skip
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(SpeedkitConfigError, match=match):
        ProfilerSchedule(**kwargs)


@pytest.mark.multiprocess
def test_each_rank_writes_its_own_trace_with_its_all_reduces(tmp_path: Path) -> None:
    from tests.helpers.multiprocess import run_script

    ranks = run_script("zero2_ddp.py", tmp_path, "--strategy", "ddp", "--steps", "5", "--profile")
    for rank, result in enumerate(ranks):
        (path,) = map(Path, result["traces"])
        assert path.name == f"rank{rank}-window0.pt.trace.json.gz"
        trace = events(path)
        assert count(trace, "speedkit/backward") == 2
        assert count(trace, "gloo:all_reduce") >= 2  # DDP's gradient all-reduce, each step


def test_the_report_descends_past_a_single_model_beside_metrics() -> None:
    class Task(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.ModuleDict(
                {"encoder": torch.nn.Linear(4, 4), "head": torch.nn.Linear(4, 2)}
            )
            self.val_acc = MulticlassAccuracy(2)  # a module, without parameters
            self.loss_fn = torch.nn.CrossEntropyLoss()

    assert [name for name, _ in _top_level(Task())] == ["model.encoder", "model.head"]
    # Two models with parameters: their shares are the report's rows.
    two = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
    assert [name for name, _ in _top_level(two)] == ["a", "b"]
