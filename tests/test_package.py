from __future__ import annotations

from pathlib import Path

import lightning_speedkit


def test_package_is_typed_and_versioned() -> None:
    root = Path(lightning_speedkit.__file__).parent
    assert (root / "py.typed").exists()
    assert lightning_speedkit.__version__.startswith("0.")
    assert "__version__" in lightning_speedkit.__all__
