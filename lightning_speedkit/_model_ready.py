"""Work on a LightningModule's layers once they exist: now, or right after ``configure_model``.

Lightning calls a callback's ``setup`` before the LightningModule's ``configure_model``,
the hook where a module that builds its layers late (for sharded or meta-device
initialisation, as Lightning recommends for large models) creates them, and no callback
hook runs between ``configure_model`` and the strategy wrapping the model (DDP, FSDP,
DeepSpeed). A callback that changes the blocks in place (ActivationCheckpointing,
RegionalCompile) would find none in ``setup``. :func:`when_model_ready` runs its work in
``setup`` when the module has no ``configure_model`` of its own, and otherwise right after
the module's own ``configure_model`` returns, still before the strategy wraps the model:
the same place in the fit for both kinds of module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.utilities.model_helpers import is_overridden

__all__ = ["forget_pending", "when_model_ready"]

#: Instance attribute of a module whose ``configure_model`` has work waiting: the
#: instance's own ``configure_model`` before the kit's (None: the class's), and the work.
_PENDING = "_speedkit_after_configure_model"


def when_model_ready(pl_module: L.LightningModule, work: Callable[[], None]) -> None:
    """Run ``work`` now, or, for a module with its own ``configure_model``, right after it.

    Works waiting on one module run in the order given, once; the module's
    ``configure_model`` is its own again as soon as they have run (or
    :func:`forget_pending` dropped them: a fit that failed before the hook).
    """
    if not is_overridden("configure_model", pl_module, _lightning_base(pl_module)):
        work()
        return
    pending: tuple[Any, list[Callable[[], None]]] | None = pl_module.__dict__.get(_PENDING)
    if pending is not None:
        pending[1].append(work)
        return
    own = pl_module.configure_model  # the module's hook, as Lightning would call it

    @functools.wraps(own)  # `__wrapped__`: Lightning still sees the module's own hook
    def configure_model() -> None:
        own()
        works = forget_pending(pl_module)
        for each in works:
            each()

    pl_module.__dict__[_PENDING] = (pl_module.__dict__.get("configure_model"), [work])
    pl_module.__dict__["configure_model"] = configure_model


def _lightning_base(pl_module: L.LightningModule) -> type[Any]:
    """The ``LightningModule`` class the module derives from: ``lightning.pytorch``'s, or
    the same class of the ``pytorch_lightning`` package (another copy of the code: its
    default ``configure_model`` is another function, which would read as the module's own).
    """
    for base in type(pl_module).__mro__:
        if base.__name__ == "LightningModule" and base.__module__.startswith(_PACKAGES):
            return base
    return L.LightningModule


_PACKAGES = ("lightning.pytorch.", "pytorch_lightning.")


def forget_pending(pl_module: L.LightningModule) -> list[Callable[[], None]]:
    """Give the module its own ``configure_model`` back; the work that was waiting on it."""
    pending = pl_module.__dict__.pop(_PENDING, None)
    if pending is None:
        return []
    before, works = pending
    if before is None:
        pl_module.__dict__.pop("configure_model", None)
    else:
        pl_module.__dict__["configure_model"] = before
    return list(works)
