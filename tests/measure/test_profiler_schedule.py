"""ProfilerSchedule: torch's schedule from Lightning hooks, marked phases, traces, never fatal."""

from __future__ import annotations

import gzip
import json
import math
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.profiler import ProfilerAction
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_speedkit import ProfilerSchedule, SpeedkitConfigError
from lightning_speedkit.measure._profiler_cycle import _first_profiled
from lightning_speedkit.measure._profiler_marks import _marked_modules, _top_level
from lightning_speedkit.measure._profiler_traces import _why_not_written
from tests.helpers.clock import VirtualClock
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


def test_a_window_without_warm_up_marks_the_fetch_before_its_first_step(tmp_path: Path) -> None:
    callback = ProfilerSchedule(skip_first=2, wait=0, warmup=0, active=2, repeat=1,
                                dirpath=tmp_path)  # fmt: skip
    fit(callback, steps=6)
    (path,) = callback.traces
    trace = events(path)
    assert count(trace, "speedkit/forward") == 2
    assert count(trace, "speedkit/data_fetch") == 2  # one before each recorded step


def test_repeat_zero_profiles_until_the_end_and_keeps_the_newest(tmp_path: Path) -> None:
    callback = ProfilerSchedule(skip_first=0, wait=0, warmup=1, active=1, repeat=0,
                                dirpath=tmp_path, num_traces_to_keep=2)  # fmt: skip
    fit(callback, steps=10)  # a window every two steps: five written, the last two kept
    assert [p.name for p in callback.traces] == [
        "rank0-window3.pt.trace.json.gz",
        "rank0-window4.pt.trace.json.gz",
    ]
    assert sorted(tmp_path.glob("*.pt.trace.json.gz")) == callback.traces


def recorded_steps(path: Path) -> list[int]:
    """The steps a trace recorded: torch's ``ProfilerStep#N`` ranges that hold a forward."""
    trace = events(path)
    forwards = [e["ts"] for e in trace if e.get("name") == "speedkit/forward"]
    return sorted(
        int(e["name"].removeprefix("ProfilerStep#"))
        for e in trace
        if e.get("name", "").startswith("ProfilerStep#") and e.get("ph") == "X"
        and any(e["ts"] <= t < e["ts"] + e["dur"] for t in forwards)
    )  # fmt: skip


def fit_resumed(make: Any, stop: int, steps: int, tmp_path: Path) -> list[ProfilerSchedule]:
    """Train ``stop`` steps, save a checkpoint, resume it to ``steps`` in a new Trainer;
    both write their traces to ``tmp_path / "traces"``."""
    callbacks = []
    checkpoint = tmp_path / "stop.ckpt"
    for max_steps, ckpt in ((stop, None), (steps, checkpoint)):
        callback = make(tmp_path / "traces")
        trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[callback])  # fmt: skip
        trainer.fit(MLP(), loader(n=256), ckpt_path=ckpt)
        if ckpt is None:
            trainer.save_checkpoint(checkpoint)
        callbacks.append(callback)
    return callbacks


@pytest.mark.parametrize(
    ("stop", "first", "second"),
    [
        (2, [], [[5, 6]]),  # before the window: the resumed run takes it whole
        (5, [], [[5, 6]]),  # in its warm-up: nothing recorded, nothing written; taken whole
        (6, [[5]], [[6]]),  # inside the recording: each run writes the steps it recorded
        (7, [[5, 6]], []),  # after the window: it is not taken again
    ],
)
def test_a_resumed_run_profiles_the_steps_the_schedule_had_left(
    tmp_path: Path, stop: int, first: list[list[int]], second: list[list[int]]
) -> None:
    """skip_first=4: one window in 10 steps, warm-up at step 4, steps 5 and 6 recorded,
    wherever the run was stopped and resumed; none twice, none lost."""

    def make(directory: Path) -> ProfilerSchedule:
        return ProfilerSchedule(skip_first=4, wait=0, warmup=1, active=2, repeat=1,
                                dirpath=directory)  # fmt: skip

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*dataloader is not resumable")
        warnings.filterwarnings("ignore", message="ProfilerSchedule recorded nothing")
        before, after = fit_resumed(make, stop, 10, tmp_path)
    assert [recorded_steps(p) for p in before.traces] == first
    assert [recorded_steps(p) for p in after.traces] == second
    names = [p.name for p in (*before.traces, *after.traces)]
    assert names == [f"rank0-window{i}.pt.trace.json.gz" for i in range(len(names))]
    # A window cut short reports the steps it ran, not torch's range for the next one.
    for callback, traces in ((before, first), (after, second)):
        if traces:
            assert callback.report is not None
            assert callback.report.steps == len(traces[-1])


def test_training_that_ends_in_a_windows_warm_up_writes_no_empty_trace(tmp_path: Path) -> None:
    """wait=0: the profiler goes from one window's last recorded step straight into the
    next one's warm-up. Four steps: the first window (steps 1 and 2) is written, the
    second, in its warm-up at step 3 when training ends, recorded nothing and is not."""
    callback = ProfilerSchedule(skip_first=0, wait=0, warmup=1, active=2, repeat=2,
                                dirpath=tmp_path)  # fmt: skip
    fit(callback, steps=4)
    assert [recorded_steps(p) for p in callback.traces] == [[1, 2]]
    assert callback.report is not None
    assert callback.report.steps == 2


class RaiseAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("stopped by the test")


def fit_until_raised(tmp_path: Path, step: int) -> ProfilerSchedule:
    """skip_first=4: warm-up at step 4, steps 5 and 6 recorded; a callback after
    ProfilerSchedule raises as step ``step`` begins."""
    callback = ProfilerSchedule(skip_first=4, wait=0, warmup=1, active=2, repeat=1,
                                dirpath=tmp_path)  # fmt: skip
    raiser = RaiseAt(step)
    trainer = L.Trainer(accelerator="cpu", max_steps=10, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback, raiser])  # fmt: skip
    with pytest.raises(RuntimeError, match="stopped by the test"):
        trainer.fit(MLP(), loader(n=256))
    assert "save_checkpoint" not in vars(trainer)  # the Trainer's own method again
    return callback


def test_a_run_that_fails_in_a_windows_warm_up_writes_no_empty_trace(tmp_path: Path) -> None:
    callback = fit_until_raised(tmp_path, 5)
    assert callback.traces == []
    assert list(tmp_path.glob("*.pt.trace.json.gz")) == []
    assert callback.state_dict()["windows"] == 0  # a resumed run takes the window whole


def test_a_step_an_exception_ends_is_marked_and_not_reported_as_one(tmp_path: Path) -> None:
    """Steps 5 and 6 recorded; an exception at the start of step 6, raised by a callback
    after ProfilerSchedule (which has opened step 6's forward): the trace is written with
    step 5, and step 6's range carries the mark that keeps it out of the report."""
    callback = fit_until_raised(tmp_path, 6)
    (path,) = callback.traces
    assert count(events(path), "speedkit/aborted") == 1
    assert callback.report is not None
    assert callback.report.steps == 1


class ValidatingMLP(MLP):
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.net(batch)


def test_validation_and_checkpoints_inside_a_window_are_marked_apart(tmp_path: Path) -> None:
    """Validation after step 5 and a checkpoint after every step, inside the window that
    records steps 4 to 6: validation has its own range, and that step is left out of the
    report; each save has a range of its own, outside the data fetch."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = ProfilerSchedule(skip_first=3, wait=0, warmup=1, active=3, repeat=1,
                                dirpath=tmp_path / "traces")  # fmt: skip
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", max_steps=8, logger=False, val_check_interval=6,
                        limit_val_batches=3, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback, saves])  # fmt: skip
    trainer.fit(ValidatingMLP(), loader(n=256), loader(n=64))
    (path,) = callback.traces
    trace = events(path)
    assert count(trace, "speedkit/validation") == 1
    assert callback.report is not None
    assert callback.report.steps == 2  # steps 4 to 6, less the one that validated
    spans = {
        name: [(e["ts"], e["ts"] + e["dur"]) for e in trace
               if e.get("name") == name and e.get("ph") == "X"]
        for name in ("speedkit/checkpoint", "speedkit/data_fetch")
    }  # fmt: skip
    assert len(spans["speedkit/checkpoint"]) >= 3
    for start, end in spans["speedkit/checkpoint"]:
        assert not any(s < end and start < e for s, e in spans["speedkit/data_fetch"])


def test_a_checkpoint_range_is_the_save_and_the_fetch_after_it_is_data(tmp_path: Path) -> None:
    """A save after every step of the window that records steps 4 to 6: each
    ``speedkit/checkpoint`` range holds one whole ``Trainer.save_checkpoint`` and ends with
    it; the fetch of the next batch, after the save, is inside ``speedkit/data_fetch``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = ProfilerSchedule(skip_first=3, wait=0, warmup=1, active=3, repeat=1,
                                dirpath=tmp_path / "traces")  # fmt: skip
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", max_steps=8, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback, saves])  # fmt: skip
    trainer.fit(MLP(), loader(n=256))
    assert "save_checkpoint" not in vars(trainer)  # the Trainer's own method again

    def spans(match: Any) -> list[tuple[float, float]]:
        return sorted((e["ts"], e["ts"] + e["dur"]) for e in events(callback.traces[0])
                      if match(e.get("name", "")) and e.get("ph") == "X")  # fmt: skip

    ranges = spans(lambda name: name == "speedkit/checkpoint")
    # with_stack: the Python frame of each call of Trainer.save_checkpoint
    calls = spans(lambda name: name.startswith("lightning/pytorch/trainer/trainer.py(")
                  and name.endswith("): save_checkpoint"))  # fmt: skip
    fetches = spans(lambda name: name.startswith("enumerate(DataLoader)"))
    marked = spans(lambda name: name == "speedkit/data_fetch")
    assert len(ranges) == len(calls) == 3  # after steps 3 to 5 (step 6's ends the window)
    for (start, end), (call_start, call_end) in zip(ranges, calls, strict=True):
        assert start <= call_start <= call_end <= end
    assert len(fetches) == 3  # of steps 4 to 6
    for start, end in fetches:
        assert not any(s < end and start < e for s, e in ranges)
        assert any(s <= start and end <= e for s, e in marked)


def test_a_checkpoint_loaded_by_validate_is_not_resumed_by_the_next_fit(tmp_path: Path) -> None:
    """validate(ckpt_path=...) loads the callback's state; a fresh fit after it is no
    resumed run and takes its window."""

    def make(directory: Path) -> ProfilerSchedule:
        return ProfilerSchedule(skip_first=2, wait=0, warmup=1, active=2, repeat=1,
                                dirpath=directory)  # fmt: skip

    (first,) = fit_resumed(make, 8, 8, tmp_path)[:1]
    assert len(first.traces) == 1
    callback = make(tmp_path / "again")
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )  # fmt: skip
    L.Trainer(**kwargs).validate(ValidatingMLP(), loader(n=64), ckpt_path=tmp_path / "stop.ckpt")
    L.Trainer(max_steps=6, **kwargs).fit(ValidatingMLP(), loader(n=256))
    assert [recorded_steps(p) for p in callback.traces] == [[3, 4]]


def test_a_resumed_run_keeps_an_endless_schedules_phase(tmp_path: Path) -> None:
    """repeat=0 with wait=2: a step recorded every four (3, 7, 11). Stopped after five
    steps, between two windows, the resumed run records 7 and 11 beside the first run's
    trace in the same directory, which it keeps."""

    def make(directory: Path) -> ProfilerSchedule:
        return ProfilerSchedule(skip_first=0, wait=2, warmup=1, active=1, repeat=0,
                                dirpath=directory)  # fmt: skip

    before, after = fit_resumed(make, 5, 12, tmp_path)
    assert [recorded_steps(p) for p in before.traces] == [[3]]
    assert [recorded_steps(p) for p in after.traces] == [[7], [11]]
    assert [p.name for p in after.traces] == [
        "rank0-window1.pt.trace.json.gz",
        "rank0-window2.pt.trace.json.gz",
    ]
    assert sorted((tmp_path / "traces").glob("*.pt.trace.json.gz")) == [
        *before.traces,
        *after.traces,
    ]


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
    callback = ProfilerSchedule(skip_first=0, wait=0, warmup=0, active=1, dirpath=blocker / "x")
    blocker.write_text("")  # after construction, which refuses a path under a file
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


def test_a_trace_folder_that_cannot_be_one_is_refused_at_construction(tmp_path: Path) -> None:
    """Before, the fit ran and warned that no trace was written."""
    taken = tmp_path / "a_file"
    taken.write_text("")
    with pytest.raises(SpeedkitConfigError, match=r"^`dirpath` is a file, got '/"):
        ProfilerSchedule(dirpath=taken)
    with pytest.raises(SpeedkitConfigError, match=r"^`dirpath` is under a file \("):
        ProfilerSchedule(dirpath=taken / "traces")
    with pytest.raises(SpeedkitConfigError, match=r"^`dirpath` must be a path or None, got 3"):
        ProfilerSchedule(dirpath=3)  # type: ignore[arg-type]
    assert (
        ProfilerSchedule(dirpath=tmp_path / "new" / "traces").dirpath == tmp_path / "new" / "traces"
    )
    assert not (tmp_path / "new").exists()  # nothing made before the fit


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


# -- faults that once killed the process: run in a child, whose exit code is the verdict ------

SHAPES = ["0w0r", "0w2r", "1w0r", "1w1r"]  # <wait>w<repeat>r; 0w0r: windows back to back


def _tmpfs(path: Path) -> bool:
    """Mount a 64 KiB filesystem at ``path`` (root only); False where that is not allowed."""
    import shutil
    import subprocess

    path.mkdir()
    mount = shutil.which("mount")
    if mount is None:
        return False
    done = subprocess.run([mount, "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)],
                          capture_output=True, check=False)  # fmt: skip
    return done.returncode == 0


def _run_faults(tmp_path: Path, specs: list[str]) -> dict[str, Any]:
    import subprocess
    import sys

    from tests.helpers.multiprocess import SCRIPTS, clean_env

    out = tmp_path / "faults.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "profiler_faults.py"), str(out), *specs],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    results: dict[str, Any] = json.loads(out.read_text())
    return results


@pytest.mark.slow
def test_a_trace_directory_that_vanishes_never_stops_training(tmp_path: Path) -> None:
    results = _run_faults(tmp_path, [f"vanish-{s}:{tmp_path / s}" for s in SHAPES])
    for shape in SHAPES:
        vanished = results[f"vanish-{shape}"]
        assert vanished["steps"] == 10, shape
        assert vanished["traces"] == [], shape
        (warning,) = vanished["warnings"]
        assert "no longer exists" in warning, warning
        assert "training goes on" in warning, warning


@pytest.mark.slow
def test_a_trace_directory_replaced_by_a_file_is_named_so(tmp_path: Path) -> None:
    shapes = ["0w0r", "1w1r"]
    results = _run_faults(tmp_path, [f"replace-{s}:{tmp_path / s}" for s in shapes])
    for shape in shapes:
        replaced = results[f"replace-{shape}"]
        assert replaced["steps"] == 10, shape
        assert replaced["traces"] == [], shape
        (warning,) = replaced["warnings"]
        assert f"the directory {tmp_path / shape / 'traces'} is now a file" in warning, warning
        assert "no longer exists" not in warning, warning


def test_why_a_trace_was_not_written_names_what_took_the_directorys_place(
    tmp_path: Path,
) -> None:
    gone, file, kept = tmp_path / "gone", tmp_path / "file", tmp_path / "kept"
    file.write_text("")
    kept.mkdir()
    error = OSError("planted")
    assert _why_not_written(gone, error) == f"the directory {gone} no longer exists"
    assert _why_not_written(file, error) == f"the directory {file} is now a file"
    assert _why_not_written(kept, PermissionError(13, "Permission denied")) == (
        "PermissionError: [Errno 13] Permission denied"
    )
    # at setup, before the directory was ever made: what is in the way, not what changed
    under = NotADirectoryError(20, "Not a directory")
    assert _why_not_written(file, FileExistsError(17, "File exists"), made=False) == (
        f"{file} is a file, not a directory"
    )
    assert _why_not_written(file / "x", under, made=False) == (
        f"cannot make the directory {file / 'x'}: Not a directory"
    )


def test_a_dirpath_that_is_a_file_is_named_so(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    callback = ProfilerSchedule(wait=0, warmup=0, active=1, dirpath=blocker)
    blocker.write_text("")  # after construction, which refuses a file
    with pytest.warns(UserWarning, match="training goes on without profiling") as record:
        fit(callback, steps=2)
    (message,) = [str(w.message) for w in record if "ProfilerSchedule" in str(w.message)]
    assert message == (
        f"ProfilerSchedule: writing to {blocker} failed ({blocker} is a file, not a "
        f"directory); training goes on without profiling."
    )


def test_inside_a_torch_profiler_block_the_advice_is_to_remove_that_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch has one profiling session per process: standing down is tested beside a real
    outer profiler in a child (test_it_stands_down_beside_another_profiler); here the
    session is one torch reports as open, and the advice is checked word for word."""
    from lightning_speedkit import _compat

    monkeypatch.setattr(_compat, "torch_profiler_enabled", lambda: True)
    callback = ProfilerSchedule(wait=0, warmup=0, active=1, dirpath=tmp_path)
    with pytest.warns(UserWarning, match="stands down") as record:
        fit(callback, steps=2)
    (message,) = [str(w.message) for w in record if "ProfilerSchedule" in str(w.message)]
    assert message == (
        "ProfilerSchedule stands down: a torch.profiler session opened around `fit()` "
        "already runs torch.profiler, and two profilers in one process crash it. Keep one: "
        "remove your own `torch.profiler.profile()` block around `fit()` (ProfilerSchedule "
        "writes traces and a report per window), or remove ProfilerSchedule from the "
        "callbacks (`speedkit report TRACE` reads torch's traces too)."
    )
    assert callback.traces == []


def test_beside_lightnings_profiler_the_advice_is_to_remove_profiler_argument() -> None:
    from types import SimpleNamespace

    from lightning.pytorch.profilers import PyTorchProfiler

    trainer = SimpleNamespace(profiler=PyTorchProfiler())
    who, advice = ProfilerSchedule._other_profiler(trainer)  # type: ignore[arg-type, misc]
    assert who == "the Trainer's `profiler=` (Lightning's PyTorchProfiler)"
    assert advice == (
        "remove `profiler=` from the Trainer (ProfilerSchedule writes traces and a report "
        "per window), or remove ProfilerSchedule from the callbacks (`speedkit report "
        "TRACE` reads Lightning's traces too)"
    )
    assert ProfilerSchedule._other_profiler(SimpleNamespace(profiler=None)) is None  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_full_filesystem_never_stops_training_nor_stays_full(tmp_path: Path) -> None:
    import subprocess

    full = {shape: tmp_path / shape for shape in SHAPES}
    if not all(_tmpfs(path) for path in full.values()):
        subprocess.run(["umount", *map(str, full.values())], capture_output=True, check=False)
        pytest.skip(
            "a 64 KiB tmpfs cannot be mounted here (needs root); a simulated full disk is "
            "tested by test_a_full_disk_is_named_and_partial_files_removed"
        )
    try:
        results = _run_faults(tmp_path, [f"full-{s}:{path}" for s, path in full.items()])
    finally:
        subprocess.run(["umount", *map(str, full.values())], check=False)
    for shape in SHAPES:
        filled = results[f"full-{shape}"]
        assert filled["steps"] == 10, shape
        (warning,) = filled["warnings"]
        assert "no space left" in warning, warning
        assert filled["left"] == [], filled["left"]  # torch's .tmp trace removed too


@pytest.mark.slow
def test_it_stands_down_beside_another_profiler(tmp_path: Path) -> None:
    results = _run_faults(tmp_path, [f"lightning:{tmp_path / 'a'}", f"outer:{tmp_path / 'b'}"])
    for case, who in (("lightning", "Trainer's `profiler=`"), ("outer", "torch.profiler session")):
        result = results[case]
        assert result["steps"] == 10
        assert result["traces"] == []
        (warning,) = result["warnings"]
        assert "stands down" in warning, warning
        assert who in warning, warning
    outer = results["outer"]["warnings"][0]
    assert "remove your own `torch.profiler.profile()` block around `fit()`" in outer
    assert "`profiler=`" not in outer


def test_a_full_disk_is_named_and_partial_files_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import lightning_speedkit.measure._profiler_traces as module

    def full_disk(path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        Path(path).write_bytes(b"partial")  # what a write cut short leaves
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module.gzip, "open", full_disk)
    callback = ProfilerSchedule(wait=0, warmup=0, active=1, repeat=0, dirpath=tmp_path)
    with pytest.warns(UserWarning, match="no space left on the device") as record:
        trainer = fit(callback, steps=6)
    assert sum("ProfilerSchedule" in str(w.message) for w in record) == 1
    assert trainer.global_step == 6
    assert sorted(tmp_path.iterdir()) == []


def test_giving_up_after_a_failed_write_writes_no_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # wait=0, warmup=0: the step() that fails to write the first window has already begun
    # the next one. Giving up stops that profiler, and its stop() must write nothing.
    real_export = torch.profiler.profile.export_chrome_trace
    calls = []

    def fails_once(self: Any, path: str, *args: Any, **kwargs: Any) -> None:
        calls.append(path)
        if len(calls) == 1:
            raise OSError("transient")
        real_export(self, path, *args, **kwargs)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", fails_once)
    callback = ProfilerSchedule(wait=0, warmup=0, active=1, repeat=0, dirpath=tmp_path)
    with pytest.warns(UserWarning, match="training goes on without profiling") as record:
        trainer = fit(callback, steps=4)
    assert sum("ProfilerSchedule" in str(w.message) for w in record) == 1
    assert trainer.global_step == 4
    assert len(calls) == 1
    assert callback.traces == []
    assert sorted(tmp_path.iterdir()) == []


def test_torchs_default_schedule_records_steps_three_to_five(tmp_path: Path) -> None:
    callback = ProfilerSchedule(wait=1, warmup=1, active=3, dirpath=tmp_path)
    fit(callback, steps=8)
    (path,) = callback.traces
    steps = {e["name"] for e in events(path) if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"}  # 0-based


def test_a_run_that_ends_before_its_window_says_so_with_the_arithmetic(tmp_path: Path) -> None:
    callback = ProfilerSchedule(skip_first=10, wait=1, warmup=1, active=3, dirpath=tmp_path)
    with pytest.warns(UserWarning, match="recorded nothing") as record:
        fit(callback, steps=8)
    (message,) = [str(w.message) for w in record if "recorded nothing" in str(w.message)]
    assert "training ran 8 batches" in message
    assert "skip_first + wait + warmup + active = 10 + 1 + 1 + 3 = 15" in message
    assert callback.traces == []


def test_a_second_fit_keeps_the_first_fits_traces(tmp_path: Path) -> None:
    callback = ProfilerSchedule(wait=0, warmup=1, active=1, dirpath=tmp_path)
    fit(callback, steps=3)
    first = callback.traces[0].read_bytes()
    fit(callback, steps=3)
    names = sorted(p.name for p in tmp_path.glob("*.pt.trace.json.gz"))
    assert names == ["rank0-window0.pt.trace.json.gz", "rank0-window1.pt.trace.json.gz"]
    assert (tmp_path / names[0]).read_bytes() == first
    assert [p.name for p in callback.traces] == [names[1]]


def test_a_trace_over_the_cap_is_not_analysed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning_speedkit.measure.profiler_schedule as module

    analysed: list[Path] = []
    monkeypatch.setattr(module, "analyze_trace", lambda raw, **kw: analysed.append(raw))
    callback = ProfilerSchedule(wait=0, warmup=0, active=1, repeat=2, dirpath=tmp_path,
                                max_trace_mb=1e-6)  # fmt: skip
    with pytest.warns(UserWarning, match="neither kept nor analysed"):
        fit(callback, steps=4)
    assert analysed == []


# ------------------------------------------------------------------ torch.compile


def _fit_compiled(callback: ProfilerSchedule, steps: int, n: int = 256) -> L.Trainer:
    torch._dynamo.reset()  # an earlier test's compiled MLP would be reused, not compiled
    model = MLP()
    model.net.compile(backend="eager", dynamic=False)  # compiles at its first call
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback])  # fmt: skip
    trainer.fit(model, loader(n=n, batch_size=16))
    return trainer


def _recorded_steps(path: Path) -> list[str]:
    return sorted(e["name"] for e in events(path) if e.get("name", "").startswith("ProfilerStep#"))


def test_a_window_waits_until_the_model_has_stopped_compiling(
    tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    # Compiling under the profiler records the compiler's own operators (an out-of-memory
    # kill with stacks on a real model). Step 0 compiles, step 1 shows it has settled:
    # the window torch's schedule puts at steps 0-2 runs at steps 2-4.
    callback = ProfilerSchedule(skip_first=0, wait=0, warmup=1, active=2, dirpath=tmp_path)
    _fit_compiled(callback, steps=6)
    (trace,) = callback.traces
    assert _recorded_steps(trace) == ["ProfilerStep#3", "ProfilerStep#4"]
    assert callback.state_dict() == {"steps": 6, "windows": 1, "delay": 2}
    assert not [w for w in recwarn if "ProfilerSchedule" in str(w.message)]


def test_an_uncompiled_model_keeps_torchs_schedule(tmp_path: Path) -> None:
    callback = ProfilerSchedule(skip_first=0, wait=0, warmup=1, active=2, dirpath=tmp_path)
    fit(callback, steps=4)
    (trace,) = callback.traces
    assert _recorded_steps(trace) == ["ProfilerStep#1", "ProfilerStep#2"]
    assert callback.state_dict()["delay"] == 0


def test_a_recompile_inside_a_window_is_named(tmp_path: Path) -> None:
    # batches of 16, 16, 16 and 8: the last one's shape recompiles, inside the window
    callback = ProfilerSchedule(skip_first=0, wait=0, warmup=1, active=2, dirpath=tmp_path)
    with pytest.warns(UserWarning, match=r"torch.compile compiled \d+ graph\(s\) during a "
                      r"profiled step") as record:  # fmt: skip
        _fit_compiled(callback, steps=5, n=56)
    assert sum("during a profiled step" in str(w.message) for w in record) == 1


def test_a_held_window_counts_in_the_nothing_recorded_arithmetic(tmp_path: Path) -> None:
    callback = ProfilerSchedule(skip_first=0, wait=0, warmup=1, active=2, dirpath=tmp_path)
    with pytest.warns(UserWarning, match=r"ran 1 batches.* = 0 \+ 0 \+ 1 \+ 2 \+ 2 held while "
                      r"torch.compile compiled = 5 batches"):  # fmt: skip
        _fit_compiled(callback, steps=1)
    assert callback.traces == []


def test_a_window_far_away_is_said_at_once(tmp_path: Path) -> None:
    # the arithmetic, not a walk over a billion steps (which took minutes)
    callback = ProfilerSchedule(skip_first=10**9, dirpath=tmp_path)
    with pytest.warns(UserWarning, match=r"= 1000000000 \+ 5 \+ 1 \+ 3 = 1000000009 batches"):
        fit(callback, steps=2)


# ------------------------------------------------------------------ outside the windows


@pytest.mark.parametrize(
    ("skip_first", "wait", "warmup", "active", "repeat"),
    [(0, 0, 0, 1, 0), (0, 5, 1, 3, 1), (3, 2, 1, 2, 2), (2, 0, 2, 1, 3), (7, 4, 0, 3, 0)],
)  # fmt: skip
def test_the_next_window_is_torchs_schedule_by_arithmetic(
    skip_first: int, wait: int, warmup: int, active: int, repeat: int
) -> None:
    kwargs = {"skip_first": skip_first, "wait": wait, "warmup": warmup, "active": active,
              "repeat": repeat}  # fmt: skip
    torchs = torch.profiler.schedule(**kwargs)
    horizon = 60
    busy = [s for s in range(horizon) if torchs(s) != ProfilerAction.NONE]
    for position in range(horizon):
        walked = next((s for s in busy if s >= position), math.inf)
        first = _first_profiled(position, **kwargs)
        assert first == walked or (walked == math.inf and first >= horizon), position


def test_no_profiler_and_no_range_outside_the_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.autograd.profiler as autograd_profiler

    import lightning_speedkit.measure._profiler_marks as module

    made: list[int] = []
    entered: list[tuple[str, int]] = []
    callback = ProfilerSchedule(skip_first=5, wait=2, warmup=1, active=2, repeat=2,
                                dirpath=tmp_path)  # fmt: skip
    real_profile, real_range = torch.profiler.profile, autograd_profiler.record_function

    def profile(*args: Any, **kwargs: Any) -> Any:
        made.append(callback._steps)
        return real_profile(*args, **kwargs)

    def record_function(name: str, *args: Any) -> Any:
        if name.startswith(("speedkit/", "ProfilerStep#")):
            entered.append((name, callback._steps))
        return real_range(name, *args)

    monkeypatch.setattr(torch.profiler, "profile", profile)
    monkeypatch.setattr(autograd_profiler, "record_function", record_function)  # torch's steps
    monkeypatch.setattr(module, "record_function", record_function)  # the phases

    class Seen(L.Callback):
        def __init__(self) -> None:
            self.with_profiler: list[int] = []

        def on_train_batch_start(self, *args: Any) -> None:
            if callback._profiler is not None:
                self.with_profiler.append(callback._steps)

    seen = Seen()
    trainer = L.Trainer(accelerator="cpu", max_steps=20, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback, seen])  # fmt: skip
    trainer.fit(MLP(), loader(n=256))
    # skip 5, then cycles of 2 idle + 1 warm-up + 2 recorded: windows at steps 7-9, 12-14
    windows = [7, 8, 9, 12, 13, 14]
    assert made == [7, 12]  # a profiler per window, made as it starts, none in between
    assert seen.with_profiler == windows
    assert len(callback.traces) == 2
    phases = [(n, s) for n, s in entered if n.startswith("speedkit/")]
    assert sorted({s for _, s in phases}) == windows
    for phase in ("forward", "backward", "optimizer_step", "module/net.0", "module/net.2"):
        assert [s for n, s in phases if n == f"speedkit/{phase}"] == windows, phase
    # torch opens the next step's range at the end of each window; stop() closes it at once
    steps = [int(n.removeprefix("ProfilerStep#")) for n, _ in entered if n[0] == "P"]
    assert steps == [7, 8, 9, 10, 12, 13, 14, 15]


# A Python frame name torch's profiler wrote with stacks on (pytorch/pytorch#130622): bytes
# that are not UTF-8, control characters among them.
GARBLED = b"getpass.py(0): \x10\xd6\x07\xc4\xff/"


def _garble(path: Path) -> None:
    """Rename the trace's first Python frame to GARBLED, as torch's export can write it."""
    raw = path.read_bytes()
    name = b'"name": "'
    start = raw.index(name, raw.index(b'"cat": "python_function"')) + len(name)
    end = raw.index(b'"', start)
    path.write_bytes(raw[:start] + GARBLED + raw[end:])


def test_frame_names_that_are_not_utf8_keep_the_compiled_models_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    real_export = torch.profiler.profile.export_chrome_trace

    def export(self: Any, path: str, *args: Any, **kwargs: Any) -> None:
        real_export(self, path, *args, **kwargs)
        _garble(Path(path))

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", export)
    callback = ProfilerSchedule(skip_first=0, wait=0, warmup=1, active=2, dirpath=tmp_path)
    assert callback.with_stack  # the default
    _fit_compiled(callback, steps=6)
    (trace,) = callback.traces
    with gzip.open(trace) as handle:
        assert GARBLED in handle.read()  # the trace is kept as torch wrote it
    assert callback.report is not None
    assert callback.report.steps == 2
    assert sorted(p.name for p in tmp_path.glob("speedkit_report*")) == REPORT
    assert not [w for w in recwarn if "ProfilerSchedule" in str(w.message)]


# ------------------------------------------------------------------ un-profiled timings


@pytest.fixture
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    """ProfilerSchedule's clock reads the virtual one; the models and datasets sleep on it."""
    from types import SimpleNamespace

    import lightning_speedkit.measure.profiler_schedule as module
    from tests.helpers import models

    clock = VirtualClock()
    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(models, "_sleep", clock.sleep)
    return clock


class PausingMLP(MLP):
    """A 0.25 s step; a validation batch takes 4 s, a checkpoint save 2 s."""

    def __init__(self) -> None:
        super().__init__(step_delay=0.25)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        from tests.helpers import models

        models._sleep(4.0)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        from tests.helpers import models

        models._sleep(2.0)


@pytest.mark.parametrize("pause", ["validation", "checkpoint"])
@pytest.mark.filterwarnings("ignore:ProfilerSchedule recorded nothing")
def test_unprofiled_steps_count_no_pause_as_data_wait(
    pause: str, virtual_clock: VirtualClock, tmp_path: Path
) -> None:
    """Steps of 0.25 s, each fetch of 8 items 0.125 s; after every second step, a pause.
    The gaps with a pause leave the un-profiled timings the report compares with (the
    fetch that follows one is not typical either); the others are exact."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    callback = ProfilerSchedule(skip_first=100, dirpath=tmp_path / "traces")  # no window
    pauses: dict[str, Any] = {
        "checkpoint": dict(callbacks=[callback, ModelCheckpoint(
            dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)]),
        "validation": dict(callbacks=[callback], enable_checkpointing=False,
                           val_check_interval=2, limit_val_batches=1),
    }  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", max_steps=6, logger=False, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False,
                        **pauses[pause])  # fmt: skip
    trainer.fit(PausingMLP(), loader(n=256, delay=1 / 64), loader(n=8))
    assert virtual_clock.now > 6 * 0.375 + 2 * 2.0  # the pauses ran
    fetches, steps = callback._unprofiled
    assert list(fetches) == [0.125] * 3  # the gaps after steps 0, 2 and 4
    assert list(steps) == [0.375] * 3


# ------------------------------------------------------------------ blocks in a ModuleList


class _Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(4 * dim, dim))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyGPT(L.LightningModule):
    """nanoGPT's layout at its simplest: an input layer, blocks in an ``nn.ModuleList``
    (which has no forward of its own: the model loops over it), an output layer."""

    VOCAB = 64

    def __init__(self, dim: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.inp = torch.nn.Embedding(self.VOCAB, dim)
        self.blocks = torch.nn.ModuleList(_Block(dim) for _ in range(layers))
        self.out = torch.nn.Linear(dim, self.VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.inp(idx)
        for block in self.blocks:
            x = block(x)
        return self.out(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (idx,) = batch
        return torch.nn.functional.cross_entropy(self(idx).flatten(0, 1), idx.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class GPT(torch.nn.Module):
    """nanoGPT's own: ``transformer`` a ModuleDict (embeddings, a ModuleList ``h``, a final
    norm), ``lm_head`` beside it."""

    def __init__(self, dim: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.transformer = torch.nn.ModuleDict(dict(
            wte=torch.nn.Embedding(16, dim), wpe=torch.nn.Embedding(8, dim),
            h=torch.nn.ModuleList(_Block(dim) for _ in range(layers)),
            ln_f=torch.nn.LayerNorm(dim)))  # fmt: skip
        self.lm_head = torch.nn.Linear(dim, 16, bias=False)


class GPTTask(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT()


def test_blocks_in_a_module_list_are_marked_under_the_lists_name() -> None:
    marked = [(name, type(module).__name__) for name, module in _marked_modules(TinyGPT())]
    assert marked == [("inp", "Embedding"), ("blocks", "_Block"), ("blocks", "_Block"),
                      ("blocks", "_Block"), ("out", "Linear")]  # fmt: skip
    # a ModuleDict's called parts, a ModuleList inside it too, under the dict's name
    marked = [(name, type(module).__name__) for name, module in _marked_modules(GPTTask())]
    assert marked == [("model.transformer", "Embedding"), ("model.transformer", "Embedding"),
                      ("model.transformer", "_Block"), ("model.transformer", "_Block"),
                      ("model.transformer", "LayerNorm"), ("model.lm_head", "Linear")]  # fmt: skip


def test_a_nanogpt_style_models_blocks_have_their_row_in_the_report(tmp_path: Path) -> None:
    callback = ProfilerSchedule(skip_first=0, wait=0, warmup=1, active=2, dirpath=tmp_path)
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback])  # fmt: skip
    tokens = torch.randint(0, TinyGPT.VOCAB, (64, 16), generator=torch.Generator().manual_seed(0))
    trainer.fit(TinyGPT(layers=3), DataLoader(TensorDataset(tokens), batch_size=8))
    (path,) = callback.traces
    trace = events(path)
    assert count(trace, "speedkit/module/blocks") == 3 * 2  # each block's forward, 2 steps
    assert count(trace, "speedkit/module/inp") == count(trace, "speedkit/module/out") == 2
    assert callback.report is not None
    assert set(callback.report.modules) == {"inp", "blocks", "out"}
    assert sum(callback.report.modules.values()) == pytest.approx(1.0)
