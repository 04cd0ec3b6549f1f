"""lightning_speedkit: make Lightning training faster without touching model code.

The public API grows with each component (see ``docs/architecture.md``).
Importing the package registers its strategy names with Lightning
(``Trainer(strategy="ddp_powersgd")``).
"""

from functools import partial
from types import SimpleNamespace

# First: a torch or Lightning older than the floor is refused, with the upgrade to make.
from lightning_speedkit import _versions  # noqa: F401
from lightning_speedkit.__about__ import __version__
from lightning_speedkit.attention import (
    AttentionSwap,
    packed_documents,
    register_adapter,
    swap_attention,
)
from lightning_speedkit.compute import (
    FrozenFeatureCache,
    FusedOptimizer,
    MicroBatchTuner,
    RegionalCompile,
    cache_frozen_features,
    compile_blocks,
    fuse_optimizers,
    tune_micro_batch,
)
from lightning_speedkit.data import NumWorkersTuner, SpeedDataModuleMixin, tune_num_workers
from lightning_speedkit.distributed import (
    ActivationCheckpointing,
    DDPHalfPrecisionStrategy,
    DDPPowerSGDStrategy,
    DeepSpeedZeRO2Strategy,
    FSDP2ZeRO2Strategy,
    FSDPZeRO2Strategy,
    HangWatchdog,
    checkpoint_blocks,
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
    "FSDP2ZeRO2Strategy",
    "FSDPZeRO2Strategy",
    "FlopCount",
    "FrozenFeatureCache",
    "FusedOptimizer",
    "HangWatchdog",
    "MicroBatchTuner",
    "NumWorkersTuner",
    "ProfilerSchedule",
    "RegionalCompile",
    "SpeedDataModuleMixin",
    "SpeedMonitor",
    "SpeedkitConfigError",
    "__version__",
    "cache_frozen_features",
    "checkpoint_blocks",
    "compile_blocks",
    "count_flops",
    "fuse_optimizers",
    "packed_documents",
    "peak_flops",
    "plan_memory",
    "register_adapter",
    "swap_attention",
    "tune_micro_batch",
    "tune_num_workers",
]


def _register_strategies() -> None:
    """Put the kit's strategy names in Lightning's ``StrategyRegistry``; again is harmless.

    Lightning's ``register`` raises on a name already present unless told
    ``override=True``, so a second import of this package (``importlib.reload``, a
    notebook re-running its cells) would fail. Each name is registered with
    ``override=True``: the entry is replaced by the same one, never duplicated.
    """
    from lightning.pytorch.strategies import StrategyRegistry

    registry = SimpleNamespace(register=partial(StrategyRegistry.register, override=True))
    for strategy in (
        DDPPowerSGDStrategy,
        DDPHalfPrecisionStrategy,
        DeepSpeedZeRO2Strategy,
        FSDPZeRO2Strategy,
        FSDP2ZeRO2Strategy,
    ):
        strategy.register_strategies(registry)


_register_strategies()
