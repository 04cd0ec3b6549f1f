"""Timing accumulation windows on its own: exact stamps in, an exact CommShare out."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_speedkit.schedule._window_timing import WARMUP_WINDOWS, WindowTimer, measure
from lightning_speedkit.schedule.policies import CommShare


class Ticks:
    """A clock whose stamps are the seconds the test sets; waits are recorded."""

    def __init__(self) -> None:
        self.t = 0.0
        self.waited: list[Any] = []

    def now(self) -> float:
        return self.t

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def wait(self, stamp: Any) -> None:
        self.waited.append(stamp)


def _window(timer: WindowTimer, clock: Ticks, accumulation: int, micro: float, sync: float,
            optimizer: float) -> None:  # fmt: skip
    """One window: ``accumulation - 1`` micro-batches of ``micro`` seconds unsynchronised,
    one of ``sync`` seconds synchronising, then the optimizer."""
    timer.open_window(accumulation)
    for _ in range(accumulation - 1):
        timer.micro_batch_start(synchronises=False)
        clock.t += micro
        timer.micro_batch_end(closes=False)
    timer.micro_batch_start(synchronises=True)
    clock.t += sync
    timer.optimizer_step()
    clock.t += optimizer
    timer.micro_batch_end(closes=True)


def test_windows_give_the_exposed_communication_exactly() -> None:
    clock = Ticks()
    timer = WindowTimer(clock)
    timer.last_end = clock.now()
    for _ in range(3):  # 3 micro-batches of 0.25 s, the synchronising one 0.75 s, 0.5 s optimizer
        _window(timer, clock, accumulation=4, micro=0.25, sync=0.75, optimizer=0.5)
    assert measure(timer.windows, clock) == CommShare(
        accumulation=4, step_s=2.0, micro_batch_s=0.25, comm_s=0.5, optimizer_s=0.5
    )
    assert clock.waited == [6.0]  # once, on the last window's end


def test_a_window_cut_by_a_gap_is_left_out() -> None:
    clock = Ticks()
    timer = WindowTimer(clock)
    timer.last_end = clock.now()
    timer.open_window(2)
    timer.micro_batch_start(synchronises=False)
    clock.t += 8.0
    timer.gap()  # validation ran here, inside the window
    timer.micro_batch_end(closes=False)
    timer.micro_batch_start(synchronises=True)
    timer.optimizer_step()
    timer.micro_batch_end(closes=True)
    _window(timer, clock, accumulation=2, micro=0.125, sync=0.375, optimizer=0.125)
    assert [w.tainted for w in timer.windows] == [True, False]
    assert measure(timer.windows, clock) == CommShare(
        2, step_s=0.625, micro_batch_s=0.125, comm_s=0.25, optimizer_s=0.125
    )
    timer.gap()  # and the next window after a gap has no previous end
    _window(timer, clock, accumulation=2, micro=0.125, sync=0.375, optimizer=0.125)
    assert timer.windows[-1].previous_end is None


def test_measurements_wait_for_enough_windows_past_warm_up_and_spend_them() -> None:
    clock = Ticks()
    timer = WindowTimer(clock)
    timer.last_end = clock.now()
    shared: list[CommShare | None] = []

    def share(measured: CommShare | None) -> CommShare | None:
        shared.append(measured)
        return measured

    for _ in range(WARMUP_WINDOWS + 1):
        _window(timer, clock, accumulation=2, micro=0.5, sync=1.0, optimizer=0.5)
    assert timer.take_measurement(2, True, share) == (False, None)
    _window(timer, clock, accumulation=2, micro=0.5, sync=1.0, optimizer=0.5)
    ready, measured = timer.take_measurement(2, True, share)
    assert ready
    assert measured == CommShare(2, step_s=2.0, micro_batch_s=0.5, comm_s=0.5, optimizer_s=0.5)
    assert timer.windows == []
    assert shared == [measured]


def test_a_rank_that_does_not_measure_takes_rank_zeros_measurement() -> None:
    clock = Ticks()
    timer = WindowTimer(clock)
    timer.last_end = clock.now()
    for _ in range(WARMUP_WINDOWS + 1):
        _window(timer, clock, accumulation=2, micro=0.5, sync=1.0, optimizer=0.5)
    rank_zero = CommShare(2, step_s=1.0, micro_batch_s=0.1, comm_s=0.3, optimizer_s=0.1)
    assert timer.take_measurement(1, False, lambda mine: mine or rank_zero) == (True, rank_zero)
    assert clock.waited == []  # this rank read no stamp


def test_without_a_clock_nothing_is_stamped() -> None:
    timer = WindowTimer()
    timer.open_window(2)
    timer.micro_batch_start(synchronises=False)
    timer.micro_batch_end(closes=False)
    assert timer.open is not None
    assert timer.open.unsynced == [(None, None)]
    assert timer.windows == []


@pytest.mark.parametrize("accumulation", [1, 2])
def test_only_unsynchronised_micro_batches_count_as_compute(accumulation: int) -> None:
    clock = Ticks()
    timer = WindowTimer(clock)
    timer.last_end = clock.now()
    _window(timer, clock, accumulation=accumulation, micro=0.25, sync=0.5, optimizer=0.125)
    measured = measure(timer.windows, clock)
    if accumulation == 1:
        assert measured is None  # no unsynchronised micro-batch to compare with
    else:
        assert measured == CommShare(2, step_s=0.875, micro_batch_s=0.25, comm_s=0.25,
                                     optimizer_s=0.125)  # fmt: skip
