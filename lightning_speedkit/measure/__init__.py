"""Measurement: FLOP counting, device peaks, SpeedMonitor and ProfilerSchedule."""

from lightning_speedkit.measure.flops import FlopCount, count_flops
from lightning_speedkit.measure.peak import PEAK_TABLE, peak_flops
from lightning_speedkit.measure.profiler_schedule import ProfilerSchedule
from lightning_speedkit.measure.speed_monitor import SUMMARY_KEYS, SpeedMonitor

__all__ = [
    "PEAK_TABLE",
    "SUMMARY_KEYS",
    "FlopCount",
    "ProfilerSchedule",
    "SpeedMonitor",
    "count_flops",
    "peak_flops",
]
