"""Distributed: communication-compressing DDP strategies, ZeRO-2 presets, memory planning."""

from lightning_speedkit.distributed.activation_checkpointing import (
    ActivationCheckpointing,
    checkpoint_blocks,
    checkpointed_blocks,
    saved_tensor_bytes,
    uncheckpoint_blocks,
)
from lightning_speedkit.distributed.deepspeed_zero2 import DeepSpeedZeRO2Strategy, zero2_bucket_size
from lightning_speedkit.distributed.fsdp2_zero2 import FSDP2ZeRO2Strategy, apply_fsdp2_zero2
from lightning_speedkit.distributed.fsdp_zero2 import FSDPZeRO2Strategy
from lightning_speedkit.distributed.half_precision import (
    DDPHalfPrecisionStrategy,
    half_precision_hook,
)
from lightning_speedkit.distributed.hang_watchdog import HangEvent, HangWatchdog, RankProgress
from lightning_speedkit.distributed.plan_memory import MemoryEstimate, MemoryPlan, plan_memory
from lightning_speedkit.distributed.powersgd import DDPPowerSGDStrategy

__all__ = [
    "ActivationCheckpointing",
    "DDPHalfPrecisionStrategy",
    "DDPPowerSGDStrategy",
    "DeepSpeedZeRO2Strategy",
    "FSDP2ZeRO2Strategy",
    "FSDPZeRO2Strategy",
    "HangEvent",
    "HangWatchdog",
    "MemoryEstimate",
    "MemoryPlan",
    "RankProgress",
    "apply_fsdp2_zero2",
    "checkpoint_blocks",
    "checkpointed_blocks",
    "half_precision_hook",
    "plan_memory",
    "saved_tensor_bytes",
    "uncheckpoint_blocks",
    "zero2_bucket_size",
]
