"""ActivationCheckpointing on a LightningModule that builds its layers in ``configure_model``.

Lightning calls the callbacks' ``setup`` before ``configure_model``, so the blocks such a
module builds there did not exist when the callback looked for them: nothing was
checkpointed, and the run said only "no repeated blocks found".
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import ActivationCheckpointing, SpeedkitConfigError
from lightning_speedkit._model_ready import forget_pending, when_model_ready
from lightning_speedkit.distributed import checkpointed_blocks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(8, 8), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(x)


class LateLayers(L.LightningModule):
    """Builds its layers in configure_model, as Lightning recommends for large models."""

    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None
        self.configured = 0

    def configure_model(self) -> None:
        self.configured += 1
        if self.net is not None:
            return
        self.net = nn.Sequential(nn.Linear(8, 8), *[Block() for _ in range(3)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.net is not None
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: L.LightningModule, callbacks: list[L.Callback], tmp_path: Any) -> L.Trainer:
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    data = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4)
    trainer.fit(module, data)
    return trainer


def test_blocks_built_in_configure_model_are_checkpointed(tmp_path: Any) -> None:
    module, callback = LateLayers(), ActivationCheckpointing(verbose=False)
    _fit(module, [callback], tmp_path)
    assert callback.checkpointed == ["net.1", "net.2", "net.3"]
    assert checkpointed_blocks(module) == ["net.1", "net.2", "net.3"]
    # Lightning called the module's own hook once, and it is the module's own again.
    assert module.configured == 1
    assert "configure_model" not in vars(module)


def test_a_second_fit_keeps_the_blocks_checkpointed_once(tmp_path: Any) -> None:
    module, callback = LateLayers(), ActivationCheckpointing(verbose=False)
    _fit(module, [callback], tmp_path)
    _fit(module, [callback], tmp_path)
    assert callback.checkpointed == ["net.1", "net.2", "net.3"]
    assert module.configured == 2
    assert "configure_model" not in vars(module)


class FailingSetup(L.Callback):
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        raise SpeedkitConfigError("refused in setup")


def test_a_fit_failing_before_configure_model_leaves_the_hook_as_it_was(tmp_path: Any) -> None:
    module = LateLayers()
    with pytest.raises(SpeedkitConfigError, match="refused in setup"):
        _fit(module, [ActivationCheckpointing(verbose=False), FailingSetup()], tmp_path)
    assert "configure_model" not in vars(module)
    assert module.net is None
    assert module.configured == 0


def test_work_waits_for_configure_model_and_runs_in_order() -> None:
    module, done = LateLayers(), []
    when_model_ready(module, lambda: done.append(("first", module.net is not None)))
    when_model_ready(module, lambda: done.append(("second", module.net is not None)))
    assert done == []
    module.configure_model()
    assert done == [("first", True), ("second", True)]
    module.configure_model()  # the module's own hook again: nothing runs twice
    assert done == [("first", True), ("second", True)]
    assert module.configured == 2


def test_work_runs_at_once_without_configure_model_and_can_be_dropped() -> None:
    done: list[str] = []
    when_model_ready(L.LightningModule(), lambda: done.append("now"))
    assert done == ["now"]
    module = LateLayers()
    when_model_ready(module, lambda: done.append("never"))
    assert len(forget_pending(module)) == 1
    module.configure_model()
    assert done == ["now"]
    assert "configure_model" not in vars(module)
