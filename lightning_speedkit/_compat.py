"""Every place the kit reads something Lightning does not type publicly, in one module."""

from __future__ import annotations

from typing import Any

import lightning as L


def log_every_n_steps(trainer: L.Trainer) -> int:
    """The Trainer's ``log_every_n_steps`` (set at runtime by its logger connector)."""
    value = getattr(trainer, "log_every_n_steps", 50)
    return int(value)


def train_loader_source(trainer: L.Trainer) -> Any:
    """Where the fit loop will request its train loader (Lightning's ``_DataLoaderSource``).

    It has ``dataloader()`` (calls the DataModule's or LightningModule's hook, or returns
    the loader passed to ``fit``), and ``instance``/``name``, which decide what is called.
    """
    return trainer.fit_loop._data_source


def replace_train_loader(trainer: L.Trainer, loader: Any) -> None:
    """Make the fit loop use ``loader`` as if it had been passed to ``fit``."""
    source = trainer.fit_loop._data_source
    source.instance = loader
    source.name = "train_dataloader"


def datamodule(trainer: L.Trainer) -> Any:
    """The Trainer's DataModule or None (a property Lightning's stubs do not declare)."""
    return getattr(trainer, "datamodule", None)


def add_callback_once(trainer: L.Trainer, callback: L.Callback) -> None:
    """Append ``callback`` to the Trainer's callbacks unless one of its type is there.

    Strategies use it from ``setup_environment``, which Lightning runs before it
    restores callback state from a checkpoint.
    """
    callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    if not any(type(c) is type(callback) for c in callbacks):
        callbacks.append(callback)
