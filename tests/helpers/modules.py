"""Import a script (a benchmark, a multi-process test script) as a module, by path."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any


def load_module(path: Path) -> ModuleType:
    """The module that ``path`` defines, executed once under its file name."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_on_small_corpus(path: Path, monkeypatch: Any) -> ModuleType:
    """A benchmark script loaded with its example DataModule reading the tests' small corpus
    (``SMALL_CORPUS``), whatever corpus size the script asks for."""
    from tests.conftest import SMALL_CORPUS

    module = load_module(path)
    init = module.VLMDataModule.__init__

    def small(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["corpus"] = SMALL_CORPUS
        init(self, *args, **kwargs)

    monkeypatch.setattr(module.VLMDataModule, "__init__", small)
    return module
