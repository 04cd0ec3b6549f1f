"""A loader's batch as Lightning's training loop hands it to ``training_step``.

The kit runs the training step on batches it takes from the train loader itself (the
micro-batch tuner's trials, a frozen-feature cache's samples read again in full): each
goes the way the fit loop sends a batch, so that ``training_step`` gets what it gets in
training. That way is the precision plugin's ``convert_input`` (a ``"bf16-true"`` cast;
a FrozenFeatureCache takes its index field out there), ``on_before_batch_transfer``,
the strategy's move to the device and ``on_after_batch_transfer`` (Lightning's
``training_epoch_loop``, ``advance``).
"""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_speedkit import _compat

__all__ = ["as_the_step_gets_it"]


def as_the_step_gets_it(trainer: L.Trainer, batch: Any) -> Any:
    """``batch`` (a train loader's) as the fit loop hands it to the step: the precision's
    input conversion, ``on_before_batch_transfer``, the move to the device and
    ``on_after_batch_transfer`` (the datamodule's hooks where it overrides them, else the
    LightningModule's), as Lightning's training epoch loop does."""
    batch = trainer.precision_plugin.convert_input(batch)
    batch = _compat.before_batch_transfer(trainer, batch)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=0)
