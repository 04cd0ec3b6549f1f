"""Schedules that change how training runs as it goes: gradient accumulation."""

from lightning_speedkit.schedule.accumulation_scheduler import (
    AccumulationChange,
    AccumulationScheduler,
    CommShare,
    accumulation_for,
)
from lightning_speedkit.schedule.policies import (
    AccumulationPolicy,
    AdaptiveToCommunication,
    StepSchedule,
    TargetGlobalBatch,
)

__all__ = [
    "AccumulationChange",
    "AccumulationPolicy",
    "AccumulationScheduler",
    "AdaptiveToCommunication",
    "CommShare",
    "StepSchedule",
    "TargetGlobalBatch",
    "accumulation_for",
]
