"""Hugging Face models from tiny configs, every dropout off, for exact comparisons."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


def tiny_model(config: str, model: str, **kwargs: Any) -> Callable[[], nn.Module]:
    """A builder of ``transformers.<model>(transformers.<config>(**kwargs))`` with every
    float ``*dropout*``/``*pdrop*`` setting at 0, so that two runs compare exactly."""

    def build() -> nn.Module:
        import transformers

        made = getattr(transformers, config)(**kwargs)
        for name in dir(made):
            if ("dropout" in name or "pdrop" in name) and isinstance(getattr(made, name), float):
                setattr(made, name, 0.0)
        return getattr(transformers, model)(made)

    return build
