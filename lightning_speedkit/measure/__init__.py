"""Measurement: FLOP counting, device peaks, and the SpeedMonitor callback."""

from lightning_speedkit.measure.flops import FlopCount, count_flops
from lightning_speedkit.measure.peak import PEAK_TABLE, peak_flops
from lightning_speedkit.measure.speed_monitor import SUMMARY_KEYS, SpeedMonitor

__all__ = ["PEAK_TABLE", "SUMMARY_KEYS", "FlopCount", "SpeedMonitor", "count_flops", "peak_flops"]
