"""Compute levers: compiled blocks, fused optimizers, the fastest micro-batch."""

from lightning_speedkit.compute._memory_probe import memory_limit
from lightning_speedkit.compute._step_timer import StepMeasurement, timed_measure
from lightning_speedkit.compute.frozen_feature_cache import (
    FrozenFeatureCache,
    cache_frozen_features,
)
from lightning_speedkit.compute.fused_optimizer import (
    FusedOptimizer,
    OptimizerSwitch,
    fuse_optimizers,
)
from lightning_speedkit.compute.micro_batch_search import MicroBatchResult, tune_micro_batch
from lightning_speedkit.compute.micro_batch_tuner import MicroBatchTuner
from lightning_speedkit.compute.regional_compile import (
    CompileWatch,
    RegionalCompile,
    compile_blocks,
    compiled_blocks,
)

__all__ = [
    "CompileWatch",
    "FrozenFeatureCache",
    "FusedOptimizer",
    "MicroBatchResult",
    "MicroBatchTuner",
    "OptimizerSwitch",
    "RegionalCompile",
    "StepMeasurement",
    "cache_frozen_features",
    "compile_blocks",
    "compiled_blocks",
    "fuse_optimizers",
    "memory_limit",
    "timed_measure",
    "tune_micro_batch",
]
