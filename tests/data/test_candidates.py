"""The worker search's grid and its pick: pure functions of counts and set rates."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from lightning_speedkit.data._candidates import IN_PROCESS, beats, candidate, choose, worker_counts


@pytest.mark.parametrize(
    ("budget", "counts"),
    [(0, [0]), (1, [0, 1]), (2, [0, 1, 2]), (3, [0, 1, 2, 3]), (6, [0, 1, 2, 4, 6]),
     (8, [0, 1, 2, 4, 8])],
)  # fmt: skip
def test_the_grid_doubles_up_to_the_budget_and_ends_on_it(budget: int, counts: list[int]) -> None:
    assert worker_counts(budget) == counts


def test_a_candidate_persists_its_workers_and_pins_only_when_asked() -> None:
    assert candidate(0, pin_memory=True) == {
        "num_workers": 0, "pin_memory": True, "persistent_workers": False,
        "prefetch_factor": None,
    }  # fmt: skip
    assert candidate(3, pin_memory=False) == {
        "num_workers": 3, "pin_memory": False, "persistent_workers": True, "prefetch_factor": 2,
    }  # fmt: skip
    assert candidate(0, pin_memory=False) == IN_PROCESS


@pytest.mark.parametrize(
    ("rate", "best", "gain", "expected"),
    [(12.6, 10.0, 0.25, True), (12.5, 10.0, 0.25, False), (10.0, 10.0, 0.0, False),
     (10.5, 10.0, 0.0, True), (0.1, 0.0, 0.05, True)],
)  # fmt: skip
def test_a_rate_beats_the_best_only_beyond_min_gain(
    rate: float, best: float, gain: float, expected: bool
) -> None:
    assert beats(rate, best, gain) is expected


_GIVEN = {"num_workers": 2, "prefetch_factor": 3}
_ZERO = {"num_workers": 0}
_ONE = {"num_workers": 1}
_TWO = {"num_workers": 2}


@pytest.mark.parametrize(
    ("given", "in_process", "workers", "expected"),
    [
        # One worker 4% slower than in-process: inside the overlap rule (half), workers win;
        # the loader as given (in-process) is only 1.04x: inside the noise band.
        ((_ZERO, 10.0), (_ZERO, 10.0), (_ONE, 9.6), (_ONE, 9.6)),
        # Workers delivering less than half the in-process rate lose to it.
        ((_ZERO, None), (_ZERO, 10.0), (_ONE, 4.9), (_ZERO, 10.0)),
        # ... at exactly half they still win.
        ((_ZERO, None), (_ZERO, 10.0), (_ONE, 5.0), (_ONE, 5.0)),
        # The loader as given, faster beyond the noise band, is kept.
        ((_GIVEN, 20.0), (_ZERO, 12.0), (_TWO, 14.0), (_GIVEN, 20.0)),
        # Slower than the pick: the pick stands.
        ((_GIVEN, 12.0), (_ZERO, 10.0), (_TWO, 24.0), (_TWO, 24.0)),
        # No worker count measured: in-process, unless the loader as given beats it.
        ((_GIVEN, None), (_ZERO, 10.0), ({}, 0.0), (_ZERO, 10.0)),
        ((_GIVEN, 11.0), (_ZERO, 10.0), ({}, 0.0), (_GIVEN, 11.0)),
        # Only the loader as given measured: it is the pick, however slow.
        ((_GIVEN, 0.5), ({}, 0.0), ({}, 0.0), (_GIVEN, 0.5)),
        # Nothing measured: nothing picked.
        ((_GIVEN, None), ({}, 0.0), ({}, 0.0), ({}, 0.0)),
    ],
    ids=["overlap-wins", "half-loses", "half-wins", "given-kept", "given-slower",
         "in-process", "given-beats-in-process", "given-only", "nothing"],
)  # fmt: skip
def test_the_pick_among_measured_rates(
    given: tuple[dict[str, Any], float | None],
    in_process: tuple[dict[str, Any], float],
    workers: tuple[dict[str, Any], float],
    expected: tuple[dict[str, Any], float],
) -> None:
    assert choose(given, in_process, workers, min_gain=0.05) == expected


def test_keeping_the_loader_as_given_logs_how_much_slower_the_pick_was(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_speedkit.data._candidates"):
        choose((_GIVEN, 20.0), (_ZERO, 8.0), (_TWO, 10.0), min_gain=0.05)
    assert caplog.messages == [
        "num_workers: {'num_workers': 2} measured 0.50x the loader as given; keeping it as given"
    ]
