"""lightning_speedkit: make Lightning training faster without touching model code.

The public API grows with each component (see ``docs/architecture.md``).
"""

from lightning_speedkit.__about__ import __version__
from lightning_speedkit.data import NumWorkersTuner, SpeedDataModuleMixin, tune_num_workers
from lightning_speedkit.errors import SpeedkitConfigError
from lightning_speedkit.measure import FlopCount, SpeedMonitor, count_flops, peak_flops

__all__ = [
    "FlopCount",
    "NumWorkersTuner",
    "SpeedDataModuleMixin",
    "SpeedMonitor",
    "SpeedkitConfigError",
    "__version__",
    "count_flops",
    "peak_flops",
    "tune_num_workers",
]
