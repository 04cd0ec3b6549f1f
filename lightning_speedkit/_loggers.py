"""Metrics the kit's callbacks log outside ``LightningModule.log``: to every logger, at the step."""

from __future__ import annotations

import lightning as L

from lightning_speedkit import _compat


def log_metrics(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Hand ``metrics`` to every logger of the Trainer at the step Lightning's own rows
    carry (:func:`~lightning_speedkit._compat.logged_step`), so that both share a step (a
    CSV file has a row per call, of that step); ``global_step`` is one ahead at a batch's
    end, and counts each
    optimizer of a manual step.

    The tuners and schedulers log from hooks where ``self.log`` is not allowed (setup,
    fit start, teardown) or at steps of their own choosing.
    """
    step = _compat.logged_step(trainer)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
