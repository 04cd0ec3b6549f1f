"""UnprofiledTimings: exact fetch and step times from the clock readings it is given."""

from __future__ import annotations

from lightning_speedkit.measure._profiler_timings import UnprofiledTimings


def run(timings: UnprofiledTimings, starts: list[float], fetch: float) -> None:
    for start in starts:
        timings.batch_starts(start, timed=True)
        timings.batch_ends(start + 1.0 - fetch)


def test_each_gap_is_a_fetch_and_each_start_to_start_a_step() -> None:
    timings = UnprofiledTimings()
    run(timings, [0.0, 1.0, 2.0, 3.0], fetch=0.25)
    fetches, steps = timings.samples
    assert list(fetches) == [0.25, 0.25, 0.25]  # from the second step on
    assert list(steps) == [1.0, 1.0, 1.0]
    assert timings.medians() == (0.25, 1000.0)


def test_a_pause_and_a_recorded_step_leave_their_gaps_untimed() -> None:
    timings = UnprofiledTimings()
    timings.batch_starts(0.0, timed=True)
    timings.batch_ends(0.5)
    timings.pause()  # validation runs from 0.5 to 10.0
    timings.batch_starts(10.0, timed=True)
    timings.batch_ends(10.5)
    timings.batch_starts(11.0, timed=False)  # a recorded step: the profiler's
    timings.batch_ends(None)
    timings.batch_starts(12.0, timed=True)
    timings.batch_ends(12.75)
    timings.batch_starts(13.0, timed=True)
    assert [list(s) for s in timings.samples] == [[0.25], [1.0]]


def test_only_the_newest_are_kept_and_a_new_fit_starts_empty() -> None:
    timings = UnprofiledTimings(keep=2)
    run(timings, [0.0, 1.0, 3.0, 6.0], fetch=0.5)
    assert list(timings.samples[1]) == [2.0, 3.0]
    assert timings.medians() == (2.0 / 2.5, 2500.0)  # fetches 1.5 and 2.5 s
    samples = timings.samples
    timings.clear()
    assert timings.samples is samples
    assert [list(s) for s in samples] == [[], []]
    assert timings.medians() == (None, None)
    timings.batch_starts(7.0, timed=True)  # the previous fit's last batch is forgotten
    assert list(samples[1]) == []


def test_a_data_share_is_at_most_the_whole_step() -> None:
    timings = UnprofiledTimings()
    timings.samples[0].extend([3.0])
    timings.samples[1].extend([2.0])
    assert timings.medians() == (1.0, 2000.0)
