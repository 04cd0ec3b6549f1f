"""A micro-batch trial leaves no trace: what it touches is kept and put back.

Gradients, buffers (batch-norm statistics), train/eval modes, the counters a step
keeps outside tensors, torchmetrics' states, and every random state (torch's, CUDA's,
Python's, NumPy's, the loader's generators). Compiled code is set aside while the
trials run, and a LightningModule's ``self.log`` does nothing in them.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_speedkit import _compat
from lightning_speedkit._counters import counters, is_counter
from lightning_speedkit._random import loader_generators, random_state_kept

__all__ = ["eager", "no_logging", "preserved"]


@contextlib.contextmanager
def preserved(model: nn.Module, loader: DataLoader[Any]) -> Iterator[None]:
    """Gradients, buffers, modes, counters, collected lists and random states of ``model``
    and ``loader``, put back after."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    # By name: a forward may assign a new tensor (``self.count = self.count + 1``).
    buffers = [(m, name, b, b.detach().clone()) for m in model.modules()
               for name, b in m.named_buffers(recurse=False)]  # fmt: skip
    modes = [(m, m.training) for m in model.modules()]
    # What a training step counts outside tensors (``self.seen += n``), what it collects
    # (Lightning's ``self.training_step_outputs.append(loss)``, emptied at the epoch's end),
    # and torchmetrics' states (not buffers): a trial's would show in the first epoch's.
    scalars = [(m, counters(m)) for m in model.modules()]
    # A counter whose default is on the class (``seen = 0`` there, or ``getattr(self,
    # "seen", 0) + n``) is first set on the module by a trial: it goes again.
    names = [(m, set(vars(m))) for m in model.modules()]
    collections = [(m, k, v, _contents(v)) for m in model.modules() for k, v in vars(m).items()
                   if not k.startswith("_") and isinstance(v, _COLLECTIONS)]  # fmt: skip
    metrics = [(m, copy.deepcopy(_compat.metric_state(m))) for m in model.modules()
               if _is_metric(m)]  # fmt: skip
    try:
        for p in params:
            p.grad = None
        model.train()
        with random_state_kept(loader_generators(loader)):
            yield
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        with torch.no_grad():
            for m, name, buffer, saved in buffers:
                buffer.copy_(saved)
                setattr(m, name, buffer)  # the buffer object it had, should it hold another
        for m, training in modes:
            m.training = training
        for m, values in scalars:
            vars(m).update(values)
        for m, before in names:
            for name in [k for k, v in vars(m).items()
                         if k not in before and not k.startswith("_") and _counted(v)]:  # fmt: skip
                delattr(m, name)  # a private one is torch's (FSDP's state, made in forward)
        for m, name, collected, before in collections:  # in place: the step may hold it
            _refill(collected, before)
            setattr(m, name, collected)  # and by name, should the step have bound another
        for m, kept in metrics:
            for name, value in kept.items():
                setattr(m, name, value)


_COLLECTIONS = (list, dict, set)


def _counted(value: Any) -> bool:
    """A value a step keeps outside tensors: a plain number or a collection."""
    return is_counter(value) or isinstance(value, _COLLECTIONS)


def _contents(value: Any) -> Any:
    """What a collection holds, one level further for the collections in a dict (a dict of
    lists, ``{"train": [], "val": []}``); the elements themselves are not copied."""
    if isinstance(value, dict):
        return {k: (v, _contents(v) if isinstance(v, _COLLECTIONS) else None)
                for k, v in value.items()}  # fmt: skip
    return list(value)


def _refill(collected: Any, contents: Any) -> None:
    """``collected`` holding ``contents`` again (:func:`_contents`), the same object."""
    collected.clear()
    if isinstance(collected, dict):
        for k, (v, inner) in contents.items():
            if inner is not None:
                _refill(v, inner)
            collected[k] = v
    elif isinstance(collected, list):
        collected.extend(contents)
    else:
        collected.update(contents)


def _is_metric(module: nn.Module) -> bool:
    metric = getattr(sys.modules.get("torchmetrics"), "Metric", None)
    return metric is not None and isinstance(module, metric)


def eager() -> contextlib.AbstractContextManager[Any]:
    """Compiled code set aside: every trial shape would otherwise compile (and count) anew."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


@contextlib.contextmanager
def no_logging(module: L.LightningModule) -> Iterator[None]:
    """``self.log`` is for the fit loop's steps: in a trial step it does nothing."""
    had = {name: name in module.__dict__ for name in ("log", "log_dict")}
    module.__dict__["log"] = module.__dict__["log_dict"] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for name, own in had.items():
            if not own:
                module.__dict__.pop(name, None)
