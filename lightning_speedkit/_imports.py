"""Availability of optional dependencies, checked once, imported where they are used."""

from __future__ import annotations

import importlib.util


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


#: nvidia-ml-py (module ``pynvml``): GPU utilisation for SpeedMonitor. ``pip install nvidia-ml-py``.
NVML_AVAILABLE = _available("pynvml")

#: flash-attn: the ``flash`` attention backend on CUDA.
#: ``pip install lightning_speedkit[flash]``.
FLASH_ATTN_AVAILABLE = _available("flash_attn")

#: xformers: the ``efficient`` attention backend on CUDA.
#: ``pip install lightning_speedkit[xformers]``.
XFORMERS_AVAILABLE = _available("xformers")

#: matplotlib: the PNG plots of benchmarks and reports.
#: ``pip install lightning_speedkit[plot]``.
MATPLOTLIB_AVAILABLE = _available("matplotlib")

#: deepspeed: the ``deepspeed_zero2`` and ``deepspeed_zero2_offload`` strategies.
#: ``pip install lightning_speedkit[deepspeed]``.
DEEPSPEED_AVAILABLE = _available("deepspeed")
