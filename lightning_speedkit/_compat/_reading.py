"""Reading a private name: its value, or the error that names the version and the feature."""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
import torch


def _missing(library: Literal["torch", "Lightning"], name: str, feature: str) -> RuntimeError:
    version = torch.__version__ if library == "torch" else L.__version__
    return RuntimeError(
        f"This {library} ({version}) has no `{name}`, which {feature}. The kit is tested "
        f"with torch 2.x up to 2.13 and Lightning 2.x up to 2.6; please report the version."
    )


def _private(owner: Any, attribute: str, library: Literal["torch", "Lightning"], name: str,
             feature: str) -> Any:  # fmt: skip
    """``owner.attribute``, or the error that names the version, ``name`` and ``feature``."""
    value = getattr(owner, attribute, None)
    if value is None:
        raise _missing(library, name, feature)
    return value
