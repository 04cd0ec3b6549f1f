"""Giving the train loader the tuned settings, and a switch that waits for the next epoch."""

from __future__ import annotations

from typing import Any

import pytest
from torch.utils.data import DataLoader

from lightning_speedkit import _compat
from lightning_speedkit.data._train_loader import NextEpochSwitch, with_settings
from lightning_speedkit.data.tune_result import TuneResult

from ..helpers.models import SlowDataset


def test_a_loader_is_rebuilt_only_when_its_settings_differ() -> None:
    given = DataLoader(SlowDataset(n=16), batch_size=4)
    same = {"num_workers": 0, "pin_memory": False}
    assert with_settings(given, same) is given
    rebuilt = with_settings(given, {"num_workers": 2, "prefetch_factor": 4})
    assert (rebuilt.num_workers, rebuilt.prefetch_factor) == (2, 4)
    assert rebuilt.sampler is given.sampler
    other = [given]  # not a single DataLoader: left as it is
    assert with_settings(other, {"num_workers": 2}) is other


def test_a_waiting_loader_is_handed_over_when_the_next_epoch_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []

    def reload_next_epoch(trainer: Any) -> Any:
        events.append("reload")
        return lambda: events.append("restored")

    monkeypatch.setattr(_compat, "reload_train_loader_next_epoch", reload_next_epoch)
    switch = NextEpochSwitch()
    found = TuneResult({"num_workers": 2}, [], 24.0)
    switch.epoch_ended(trainer=None)  # nothing waits: the loop is left alone
    assert switch.epoch_started() is None
    assert events == []
    switch.wait(found)
    switch.epoch_ended(trainer=None)
    switch.epoch_ended(trainer=None)  # once only
    assert events == ["reload"]
    assert switch.epoch_started() is found
    assert events == ["reload", "restored"]
    assert switch.epoch_started() is None  # handed over once


def test_a_fit_that_ends_before_the_next_epoch_puts_the_setting_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    monkeypatch.setattr(_compat, "reload_train_loader_next_epoch",
                        lambda trainer: lambda: events.append("restored"))  # fmt: skip
    switch = NextEpochSwitch()
    switch.wait(TuneResult({"num_workers": 2}, [], 24.0))
    switch.epoch_ended(trainer=None)
    switch.restore()  # teardown
    switch.restore()
    assert events == ["restored"]
    switch.forget()
    assert switch.waiting is None
