"""The worker search's results on disk, one file per dataset, machine, worker budget and
torch version; only measured results are written, and one reached by failures is not read."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_speedkit.data.tune_result import TuneResult
from lightning_speedkit.data.worker_cores import cpu_budget

# 3: results chosen against the loader as given, and only measured ones cached (entries
# of version 2 may hold a num_workers=0 that every candidate failing had forced).
CACHE_VERSION = 3


def fingerprint(loader: DataLoader[Any], local_world_size: int, budget: int) -> str:
    """The name of ``loader``'s cache entry: what makes a measured result hold (the dataset
    and its own ``fingerprint``, batching, machine, cores, worker budget, device, torch)."""
    dataset = loader.dataset
    custom = getattr(dataset, "fingerprint", None)
    parts = {
        "version": CACHE_VERSION,
        "dataset": f"{type(dataset).__module__}.{type(dataset).__qualname__}",
        "dataset_fingerprint": custom() if callable(custom) else custom,
        "len": len(dataset) if hasattr(dataset, "__len__") else None,
        "batch_size": loader.batch_size,
        "collate": getattr(loader.collate_fn, "__qualname__", type(loader.collate_fn).__qualname__),
        "machine": platform.node(),
        "cores": cpu_budget(1),
        "local_world_size": local_world_size,
        "worker_budget": budget,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lightning_speedkit/num_workers`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning_speedkit" / "num_workers"


def read_cache(path: Path) -> TuneResult | None:
    """The result kept at ``path``; None when there is none, it cannot be read, or a
    candidate failed in it (a choice failures forced is measured again)."""
    try:
        data = json.loads(path.read_text())
        data.update(cached=True, seconds=0.0)
        result = TuneResult(**data)
    except (OSError, ValueError, TypeError):  # missing or unreadable: measure again
        return None
    if any(row.get("skipped") for row in result.table):  # reached by failures: measure again
        return None
    return result


def write_cache(path: Path, result: TuneResult) -> None:
    """Keep ``result`` at ``path`` (written whole, then moved into place); a cache that
    cannot be written is said once and costs the next run a search, nothing more."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result.to_json(), indent=2))
        tmp.replace(path)
    except OSError as exc:  # a cache that cannot be written costs a retune, nothing more
        rank_zero_warn(
            f"NumWorkersTuner: could not write its cache at {path} ({exc}); tuning will run again."
        )
