"""lightning_speedkit: make Lightning training faster without touching model code.

The public API grows with each component (see ``docs/architecture.md``).
Importing the package registers its strategy names with Lightning
(``Trainer(strategy="ddp_powersgd")``).
"""

from functools import partial
from types import SimpleNamespace
from typing import Any

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

    names: list[str] = []

    def register(name: str, strategy: Any, description: str, **init_params: Any) -> None:
        names.append(name)
        StrategyRegistry.register(name, strategy, description, override=True, **init_params)

    registry = SimpleNamespace(register=register)
    for strategy in (
        DDPPowerSGDStrategy,
        DDPHalfPrecisionStrategy,
        DeepSpeedZeRO2Strategy,
        FSDPZeRO2Strategy,
        FSDP2ZeRO2Strategy,
    ):
        strategy.register_strategies(registry)
    _refuse_under_pytorch_lightning(names)


def _refuse_under_pytorch_lightning(names: list[str]) -> None:
    """The kit's strategy names in the ``pytorch_lightning`` package's registry too, each
    refusing with the fix: that package is another copy of Lightning, whose Trainer takes
    only its own strategy classes, and would say only that the name is unknown.

    Only where the user imported that package already: importing it moves every one of
    Lightning's own log messages (``rank_zero_info``) to the ``pytorch_lightning`` logger,
    which a ``lightning.pytorch`` user's logging settings would no longer reach.
    """
    import sys

    if "pytorch_lightning.strategies" not in sys.modules:
        return
    from pytorch_lightning.strategies import StrategyRegistry as OtherRegistry

    for name in names:
        if name not in OtherRegistry:
            refuse = partial(_refuse_strategy, name)
            OtherRegistry.register(name, refuse, description="lightning_speedkit's, refused here")


def _refuse_strategy(name: str, **_: object) -> None:
    raise SpeedkitConfigError(
        f"`strategy={name!r}` is a lightning_speedkit strategy, built on `lightning.pytorch`; "
        f"`pytorch_lightning.Trainer` (the same Lightning under its older package name) "
        f"cannot run it. Build the Trainer from `lightning.pytorch` (`import lightning.pytorch "
        f"as pl`); the kit's callbacks work under either."
    )


_register_strategies()
