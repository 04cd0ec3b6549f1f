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
