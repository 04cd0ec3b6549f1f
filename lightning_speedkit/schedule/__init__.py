"""Schedules that change how training runs as it goes: gradient accumulation."""

from lightning_speedkit.schedule.accumulation_scheduler import (
    AccumulationChange,
    AccumulationScheduler,
    CommShare,
    accumulation_for,
)

__all__ = ["AccumulationChange", "AccumulationScheduler", "CommShare", "accumulation_for"]
