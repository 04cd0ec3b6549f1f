"""Distributed: communication-compressing DDP strategies."""

from lightning_speedkit.distributed.powersgd import DDPHalfPrecisionStrategy, DDPPowerSGDStrategy

__all__ = ["DDPHalfPrecisionStrategy", "DDPPowerSGDStrategy"]
