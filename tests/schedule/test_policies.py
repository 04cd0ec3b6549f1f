"""The accumulation policies on their own: no Trainer, no clock, exact answers."""

from __future__ import annotations

import warnings

import pytest

from lightning_speedkit import SpeedkitConfigError
from lightning_speedkit.schedule import (
    AdaptiveToCommunication,
    CommShare,
    StepSchedule,
    TargetGlobalBatch,
)
from lightning_speedkit.schedule.policies import build_policy, first_global_batch

PROBE = "adaptive probe: one unsynchronised micro-batch to measure communication"


# -- TargetGlobalBatch ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("global_batch", "micro", "world", "expected"),
    [(256, 8, 4, 8), (64, 8, 2, 4), (64, 8, 1, 8), (8, 8, 1, 1), (128, 32, 4, 1)],
)
def test_target_is_the_global_batch_over_micro_batch_and_ranks(
    global_batch: int, micro: int, world: int, expected: int
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # made exactly: no rounding warning
        policy = TargetGlobalBatch(global_batch, micro_batch=micro, world_size=world)
        assert [policy.accumulation(step) for step in (0, 1, 1000)] == [expected] * 3
    assert policy.reason == f"target global batch {global_batch}"


def test_target_rounds_to_the_closest_with_one_warning() -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        policy = TargetGlobalBatch(100, micro_batch=8, world_size=4)
        answers = [policy.accumulation(step) for step in range(5)]
    assert answers == [3] * 5  # 96 samples, not 128
    assert [str(w.message) for w in record] == [
        "AccumulationScheduler: a global batch of 100 cannot be made of micro-batches of 8 "
        "on 4 rank(s); using 3 micro-batch(es) per step, a global batch of 96."
    ]


def test_no_target_is_one_micro_batch_per_step() -> None:
    policy = TargetGlobalBatch(None, micro_batch=8, world_size=4)
    assert (policy.accumulation(0), policy.reason) == (1, "one micro-batch per step")


# -- StepSchedule -----------------------------------------------------------------------------


def test_step_schedule_answers_from_each_key_on() -> None:
    policy = StepSchedule({3: 24, 0: 8, 7: 32}, micro_batch=8, world_size=1)
    answers = []
    for step in range(9):
        answers.append((step, policy.accumulation(step), policy.reason))
    assert answers == [
        (0, 1, "schedule[0] = 8"),
        (1, 1, "schedule[0] = 8"),
        (2, 1, "schedule[0] = 8"),
        (3, 3, "schedule[3] = 24"),
        (4, 3, "schedule[3] = 24"),
        (5, 3, "schedule[3] = 24"),
        (6, 3, "schedule[3] = 24"),
        (7, 4, "schedule[7] = 32"),
        (8, 4, "schedule[7] = 32"),
    ]
    assert list(policy.schedule) == [0, 3, 7]  # sorted


def test_step_schedule_before_its_first_key_takes_one_micro_batch() -> None:
    policy = StepSchedule({2: 64}, micro_batch=8, world_size=2)
    assert [policy.accumulation(step) for step in range(4)] == [1, 1, 4, 4]
    policy.accumulation(1)
    assert policy.reason == "before the schedule's first key"


def test_epoch_schedule_reads_the_epoch_not_the_step() -> None:
    policy = StepSchedule({1: 16, 3: 64}, micro_batch=8, world_size=1, unit="epoch")
    assert policy.accumulation(step=500, epoch=0) == 1
    assert policy.accumulation(step=0, epoch=1) == 2
    assert policy.accumulation(step=5, epoch=2) == 2
    assert policy.accumulation(step=5, epoch=3) == 8
    assert policy.reason == "schedule[3] = 64"


def test_step_schedule_warns_once_per_global_batch_it_cannot_make() -> None:
    policy = StepSchedule({0: 30, 2: 32, 4: 50}, micro_batch=8, world_size=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        answers = [policy.accumulation(step) for step in range(6) for _ in range(2)]
    assert answers == [4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6]
    assert [str(w.message).split(";")[0] for w in record] == [
        "AccumulationScheduler: a global batch of 30 cannot be made of micro-batches of 8 "
        "on 1 rank(s)",
        "AccumulationScheduler: a global batch of 50 cannot be made of micro-batches of 8 "
        "on 1 rank(s)",
    ]


@pytest.mark.parametrize(
    ("schedule", "match"),
    [({}, "non-empty"), ({-1: 8}, "counted from 0"), ({0: 0}, r"schedule\[0\]")],
)
def test_step_schedule_refuses_bad_schedules(schedule: dict[int, int], match: str) -> None:
    with pytest.raises(SpeedkitConfigError, match=match):
        StepSchedule(schedule, micro_batch=8, world_size=1)


# -- AdaptiveToCommunication ------------------------------------------------------------------

# Times in binary fractions of a second, so every share below is exact.
SLOW_COMM = CommShare(accumulation=2, step_s=0.5625, micro_batch_s=0.03125, comm_s=0.5,
                      optimizer_s=0.0)  # fmt: skip
COMPUTE_BOUND = CommShare(accumulation=2, step_s=0.5, micro_batch_s=0.25, comm_s=0.0,
                          optimizer_s=0.0)  # fmt: skip


def adaptive(
    target: int | None = None,
    max_global_batch: int = 256,
    resumed_global_batch: int | None = None,
    probed: bool = False,
    next_check: int = 0,
) -> AdaptiveToCommunication:
    """Micro-batches of 8 on 2 ranks, threshold 25%."""
    start = TargetGlobalBatch(target, micro_batch=8, world_size=2)
    return AdaptiveToCommunication(start, max_global_batch, 0.25, probed=probed,
                                   resumed_global_batch=resumed_global_batch,
                                   next_check=next_check)  # fmt: skip


def test_adaptive_probes_at_two_from_one_micro_batch() -> None:
    policy = adaptive()
    assert (policy.accumulation(0), policy.reason, policy.probed) == (2, PROBE, True)
    assert (policy.floor, policy.ceiling) == (1, 16)  # 256 / (8 x 2)
    assert policy.measures(0)


def test_adaptive_rises_to_the_smallest_accumulation_under_the_threshold() -> None:
    # 0.5 s of communication against 1/32 s per micro-batch: share(k) = 0.5 / (k/32 + 0.5)
    # is 1/4 at k = 48; the ceiling is 1024 / 16 = 64.
    policy = adaptive(max_global_batch=1024)
    policy.observe(SLOW_COMM, step=5)
    assert policy.accumulation(5) == 48
    assert policy.reason == (
        "communication 89% of the step at accumulation 2 (threshold 25%); predicted 25% at 48"
    )
    assert policy.measures(5)  # the new accumulation is measured at once


def test_adaptive_stops_at_max_global_batch_and_says_so() -> None:
    policy = adaptive(max_global_batch=256)
    policy.observe(SLOW_COMM, step=5)
    assert policy.accumulation(5) == 16
    assert policy.reason == (
        "communication 89% of the step at accumulation 2 (threshold 25%); predicted 50% at 16 "
        "(the most `max_global_batch` allows)"
    )


def test_adaptive_goes_back_to_one_after_the_probe_when_compute_dominates() -> None:
    policy = adaptive()
    policy.observe(COMPUTE_BOUND, step=5)
    assert policy.accumulation(5) == 1
    assert policy.reason == (
        "communication 0% of the step at accumulation 2 (threshold 25%); predicted 0% at 1"
    )
    assert not policy.measures(5)  # one micro-batch: nothing unsynchronised to time
    assert not policy.measures(10_000)


def test_adaptive_never_lowers_after_the_probe_and_rechecks_100_steps_later() -> None:
    policy = adaptive(max_global_batch=1024)
    policy.observe(SLOW_COMM, step=5)
    assert policy.accumulation(5) == 48
    reason = policy.reason
    policy.observe(CommShare(48, 12.0, 0.25, 0.0, 0.0), step=20)  # no communication now
    assert (policy.accumulation(20), policy.reason) == (48, reason)
    assert policy.next_check == 120
    assert not policy.measures(119)
    assert policy.measures(120)


def test_adaptive_without_a_measurement_ends_the_probe() -> None:
    policy = adaptive()
    policy.observe(None, step=5)
    assert policy.accumulation(5) == 2
    policy.observe(COMPUTE_BOUND, step=10)  # the probe is over: it no longer goes below 2
    assert policy.accumulation(10) == 2
    assert policy.next_check == 110


def test_adaptive_starts_at_its_target_without_probing() -> None:
    policy = adaptive(target=32)
    assert (policy.accumulation(0), policy.reason, policy.probed) == (
        2,
        "target global batch 32",
        False,
    )
    policy.observe(COMPUTE_BOUND, step=5)
    assert policy.accumulation(5) == 2  # the target is the floor


@pytest.mark.parametrize(
    ("target", "resumed", "expected"),
    [(None, 128, 8), (None, 4096, 16), (32, 16, 2), (None, 16, 1)],
)
def test_adaptive_resumes_at_its_global_batch_within_floor_and_ceiling(
    target: int | None, resumed: int, expected: int
) -> None:
    policy = adaptive(target=target, resumed_global_batch=resumed, probed=True)
    assert policy.accumulation(0) == expected
    assert policy.reason == f"resumed at global batch {resumed}"


def test_adaptive_probes_once_per_run() -> None:
    policy = adaptive(probed=True, next_check=300)
    assert (policy.accumulation(0), policy.reason) == (1, "one micro-batch per step")
    assert policy.next_check == 300


def test_adaptive_ceiling_is_whole_micro_batches_and_never_below_the_floor() -> None:
    assert adaptive(max_global_batch=100).ceiling == 6  # 100 // 16
    assert adaptive(target=64, max_global_batch=64).ceiling == 4
    policy = adaptive(max_global_batch=16)  # one micro-batch is the most: nothing to probe
    assert (policy.ceiling, policy.accumulation(0), policy.probed) == (1, 1, False)


def test_build_policy_picks_the_mode_the_arguments_ask_for() -> None:
    assert isinstance(build_policy(8, 2, schedule={0: 32}), StepSchedule)
    assert isinstance(build_policy(8, 2, target_global_batch=64), TargetGlobalBatch)
    adaptive = build_policy(8, 2, target_global_batch=32, max_global_batch=128, probed=True,
                            next_check=40)  # fmt: skip
    assert isinstance(adaptive, AdaptiveToCommunication)
    assert (adaptive.accumulation(0), adaptive.ceiling, adaptive.next_check) == (2, 8, 40)
    assert first_global_batch(8, schedule={10: 64}) == 8  # before the first key: one micro-batch
    assert first_global_batch(8, schedule={0: 64}) == 64
    assert first_global_batch(8, target_global_batch=256) == 256
