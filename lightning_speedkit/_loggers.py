"""Metrics the kit's callbacks log outside ``LightningModule.log``: to every logger, at the step."""

from __future__ import annotations

import lightning as L


def log_metrics(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Hand ``metrics`` to every logger of the Trainer at its global step.

    The tuners and schedulers log from hooks where ``self.log`` is not allowed (setup,
    fit start, teardown) or at steps of their own choosing.
    """
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
