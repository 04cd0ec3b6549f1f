"""lightning_speedkit: make Lightning training faster without touching model code.

The public API grows with each component (see ``docs/architecture.md``).
Importing the package registers its strategy names with Lightning
(``Trainer(strategy="ddp_powersgd")``).
"""

from lightning_speedkit.__about__ import __version__
from lightning_speedkit.attention import AttentionSwap, register_adapter, swap_attention
from lightning_speedkit.data import NumWorkersTuner, SpeedDataModuleMixin, tune_num_workers
from lightning_speedkit.distributed import (
    ActivationCheckpointing,
    DDPHalfPrecisionStrategy,
    DDPPowerSGDStrategy,
    DeepSpeedZeRO2Strategy,
    FSDPZeRO2Strategy,
    plan_memory,
)
from lightning_speedkit.errors import SpeedkitConfigError
from lightning_speedkit.measure import (
    FlopCount,
    ProfilerSchedule,
    SpeedMonitor,
    count_flops,
    peak_flops,
)
from lightning_speedkit.schedule import AccumulationScheduler

__all__ = [
    "AccumulationScheduler",
    "ActivationCheckpointing",
    "AttentionSwap",
    "DDPHalfPrecisionStrategy",
    "DDPPowerSGDStrategy",
    "DeepSpeedZeRO2Strategy",
    "FSDPZeRO2Strategy",
    "FlopCount",
    "NumWorkersTuner",
    "ProfilerSchedule",
    "SpeedDataModuleMixin",
    "SpeedMonitor",
    "SpeedkitConfigError",
    "__version__",
    "count_flops",
    "peak_flops",
    "plan_memory",
    "register_adapter",
    "swap_attention",
    "tune_num_workers",
]


def _register_strategies() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for strategy in (
        DDPPowerSGDStrategy,
        DDPHalfPrecisionStrategy,
        DeepSpeedZeRO2Strategy,
        FSDPZeRO2Strategy,
    ):
        strategy.register_strategies(StrategyRegistry)


_register_strategies()
