"""StepMarks and TimedSaves: the regions of profiled steps, opened and closed across hooks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import lightning_speedkit.measure._profiler_marks as marks_module
from lightning_speedkit.measure._profiler_marks import StepMarks, TimedSaves


@pytest.fixture
def regions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What StepMarks opens ("+name") and closes ("-name"), in order, without a profiler."""
    log: list[str] = []

    class Range:
        def __init__(self, name: str) -> None:
            self.name = name.removeprefix("speedkit/")

        def __enter__(self) -> None:
            log.append("+" + self.name)

        def __exit__(self, *args: Any) -> None:
            log.append("-" + self.name)

    monkeypatch.setattr(marks_module, "record_function", Range)
    return log


def test_a_recorded_step_marks_each_phase_from_hook_to_hook(regions: list[str]) -> None:
    marks = StepMarks()
    marks.fetch(recording=True)
    marks.forward(recording=True)
    marks.backward(recording=True)
    marks.backward_ends()
    marks.optimizer_step(recording=True)
    marks.close_all()
    assert regions == ["+data_fetch", "-data_fetch", "+forward", "-forward", "+backward",
                       "-backward", "+optimizer_step", "-optimizer_step"]  # fmt: skip


def test_a_step_not_recorded_opens_nothing(regions: list[str]) -> None:
    marks = StepMarks()
    marks.fetch(recording=False)
    marks.forward(recording=False)
    marks.backward(recording=False)
    marks.optimizer_step(recording=False)
    assert marks.pause("validation", recording=False) is False
    marks.close_all()
    assert regions == []


def test_a_pause_interrupts_the_fetch_and_gives_it_back(regions: list[str]) -> None:
    marks = StepMarks()
    marks.fetch(recording=True)
    fetching = marks.pause("checkpoint", recording=True)
    marks.pause_ends("checkpoint", fetching, recording=True)
    assert fetching is True
    assert regions == ["+data_fetch", "-data_fetch", "+checkpoint", "-checkpoint", "+data_fetch"]


def test_an_aborted_step_closes_its_regions_and_says_so(regions: list[str]) -> None:
    marks = StepMarks()
    marks.forward(recording=True)
    marks.aborted()
    assert regions == ["+forward", "-forward", "+aborted", "-aborted"]


def test_module_forwards_are_marked_while_recording_until_unhooked(regions: list[str]) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    recording = [True]
    marks = StepMarks()
    marks.hook_modules(model, lambda: recording[0])
    model(torch.ones(1, 2))
    recording[0] = False
    model(torch.ones(1, 2))
    marks.unhook_modules()
    recording[0] = True
    model(torch.ones(1, 2))
    assert regions == ["+module/0", "-module/0", "+module/1", "-module/1"]


def test_timed_saves_wrap_the_trainers_save_and_put_back_the_users_own() -> None:
    calls: list[str] = []

    class Trainer:
        def save_checkpoint(self, path: str) -> None:
            calls.append(path)

    trainer = Trainer()
    users = trainer.save_checkpoint  # an override of the user's, on the instance
    vars(trainer)["save_checkpoint"] = users
    saves = TimedSaves()
    saves.wrap(trainer, lambda: calls.append("begins") is None, lambda b: calls.append(f"ends {b}"))
    trainer.save_checkpoint("a.ckpt")
    saves.restore()
    saves.restore()  # twice: nothing more to do
    trainer.save_checkpoint("b.ckpt")
    assert calls == ["begins", "a.ckpt", "ends True", "b.ckpt"]
    assert vars(trainer)["save_checkpoint"] is users


def test_a_failing_save_still_ends_its_pause() -> None:
    ended: list[bool] = []

    def save(path: str) -> None:
        raise OSError("disk full")

    trainer = SimpleNamespace(save_checkpoint=save)
    saves = TimedSaves()
    saves.wrap(trainer, lambda: False, ended.append)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_checkpoint("a.ckpt")
    assert ended == [False]
