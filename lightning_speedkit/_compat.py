"""Every place the kit reads something Lightning does not type publicly, in one module."""

from __future__ import annotations

import lightning as L


def log_every_n_steps(trainer: L.Trainer) -> int:
    """The Trainer's ``log_every_n_steps`` (set at runtime by its logger connector)."""
    value = getattr(trainer, "log_every_n_steps", 50)
    return int(value)
