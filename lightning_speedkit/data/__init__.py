"""Data pipeline: worker tuning, length bucketing, sequence packing, sample caching."""

from lightning_speedkit.data.bucketing import LengthBucketBatchSampler
from lightning_speedkit.data.cache import SampleCache
from lightning_speedkit.data.mixin import SpeedDataModuleMixin
from lightning_speedkit.data.num_workers_tuner import NumWorkersTuner
from lightning_speedkit.data.packing import PackingCollate, document_mask
from lightning_speedkit.data.rebuild import rebuild_dataloader
from lightning_speedkit.data.tune_result import TuneResult
from lightning_speedkit.data.worker_search import tune_num_workers

__all__ = [
    "LengthBucketBatchSampler",
    "NumWorkersTuner",
    "PackingCollate",
    "SampleCache",
    "SpeedDataModuleMixin",
    "TuneResult",
    "document_mask",
    "rebuild_dataloader",
    "tune_num_workers",
]
