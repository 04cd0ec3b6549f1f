"""``--model MODULE:FACTORY``: the user's model, built on the meta device and counted.

``speedkit plan`` sizes a real model by its parameters, trainable and frozen apart. The
factory is the user's code: whatever stops it from giving a model (no such module, a
module or factory that raises, arguments it needs, something not a module) is input the
command cannot use, refused as one line naming the factory, never a traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from lightning_speedkit.cli._parser import CommandLineError

EXAMPLE_MODEL = "speedkit_examples.vlm:VLM"
"""The example VLM, built with its default config: what ``--model``'s help names."""


@contextlib.contextmanager
def _current_directory_first() -> Iterator[None]:
    """The current directory first on ``sys.path`` while the user's code runs, as under
    ``python -m``: the import, and the factory and hook that may import a module beside
    theirs only when called (``def build(): from mymodels import Net``)."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _import_module(module_name: str, spec: str) -> ModuleType:
    """``module_name`` imported, or the reason it cannot be, as one line."""
    import importlib

    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise CommandLineError(
            f"argument --model: cannot import {module_name!r} (from {spec!r}): {err}"
        ) from err
    except Exception as err:  # the user's module failed as it ran: their code, not ours
        raise CommandLineError(
            f"argument --model: importing {module_name!r} (from {spec!r}) raised "
            f"{type(err).__name__}: {err}; fix the module so that it imports, or give "
            "--params instead"
        ) from err


def _model_builder(spec: str) -> tuple[Callable[[], Any], str]:
    """What ``--model MODULE:FACTORY`` names, as a function of no arguments, and a note.

    The example VLM's class is built with its default config (the ``tiny`` preset).
    """
    import inspect

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CommandLineError(
            f"argument --model: expected MODULE:FACTORY, e.g. {EXAMPLE_MODEL}, got {spec!r}"
        )
    module = _import_module(module_name, spec)
    build: Any = module
    for part in attr.split("."):
        build = getattr(build, part, None)
    if not callable(build):
        raise CommandLineError(
            f"argument --model: {module_name} has no function or class {attr!r} (from {spec!r})"
        )
    if getattr(build, "__module__", "").startswith("speedkit_examples.vlm"):
        from speedkit_examples.vlm import VLM, CaptionTokenizer, VLMConfig

        if build is VLM:
            vocab = CaptionTokenizer().vocab_size
            return (lambda: VLM(VLMConfig(vocab_size=vocab))), " (VLMConfig's defaults)"
    try:
        signature = inspect.signature(build)
    except ValueError:  # no signature to read (a builtin): calling it will tell
        return build, ""
    required = [
        name
        for name, p in signature.parameters.items()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        raise CommandLineError(
            f"argument --model: {spec} needs arguments ({', '.join(required)}); name a "
            "function that builds the model without any, e.g. `def build(): return "
            "MyModel(MyConfig())`, as --model MODULE:build"
        )
    return build, ""


def count_parameters(spec: str) -> tuple[int, int, str]:
    """``(all, trainable, note)`` of ``--model``'s model, built on the meta device.

    Its module is imported, and its factory and ``configure_model`` run, with the
    current directory first on ``sys.path``, as under ``python -m``.
    """
    with _current_directory_first():
        model, note = _build_model(spec)
    seen = {id(p): p for p in model.parameters()}  # tied parameters once
    return (sum(p.numel() for p in seen.values()),
            sum(p.numel() for p in seen.values() if p.requires_grad), note)  # fmt: skip


def _build_model(spec: str) -> tuple[Any, str]:
    """``--model``'s model on the meta device, its ``configure_model`` run, and a note."""
    import torch

    build, note = _model_builder(spec)
    try:
        with torch.device("meta"):  # no memory: a 70B model counts in a second
            model = build()
    except Exception as err:  # the user's factory failed: their code, not ours
        raise CommandLineError(
            f"argument --model: {spec} raised {type(err).__name__}: {err} (called with no "
            "arguments, on the meta device); fix the factory so that it builds the model, "
            "or give --params instead"
        ) from err
    if not isinstance(model, torch.nn.Module):
        raise CommandLineError(
            f"argument --model: {spec} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model, note + _configure_model(model, spec)


def _configure_model(model: Any, spec: str) -> str:
    """A LightningModule that builds its layers in ``configure_model`` (as Lightning
    recommends for large models) has them built, on the meta device, as the Trainer
    would before training; the note says so. Without this the parameters counted were
    only those made in ``__init__``, often none."""
    import torch

    # A LightningModule's module imported Lightning already: nothing to import otherwise.
    for package in ("lightning.pytorch", "pytorch_lightning"):
        lightning = sys.modules.get(package)
        base = getattr(lightning, "LightningModule", None)
        if base is not None and isinstance(model, base):
            break
    else:
        return ""
    if type(model).configure_model is base.configure_model:
        return ""
    try:
        with torch.device("meta"):
            model.configure_model()
    except Exception as err:  # the user's hook failed: their code, not ours
        raise CommandLineError(
            f"argument --model: {spec}'s configure_model() raised {type(err).__name__}: "
            f"{err} (called on the meta device, as the Trainer calls it before training); "
            "fix the hook, or give --params instead"
        ) from err
    return " (after its configure_model)"
