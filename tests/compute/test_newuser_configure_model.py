"""RegionalCompile on a LightningModule that builds its layers in ``configure_model``.

Lightning calls the callbacks' ``setup`` before ``configure_model``: the blocks such a
module builds there were not found, nothing was compiled, and the run said only "no
repeated blocks found".
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import ActivationCheckpointing, RegionalCompile
from lightning_speedkit.compute.regional_compile import compiled_blocks
from lightning_speedkit.distributed import checkpointed_blocks


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(8, 8), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(x)


class LateLayers(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(8, 8), *[Block() for _ in range(2)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.net is not None
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_blocks_built_in_configure_model_compile_and_checkpoint(tmp_path: Any) -> None:
    module = LateLayers()
    compile_ = RegionalCompile(backend="eager", verbose=False)
    checkpoint = ActivationCheckpointing(verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, callbacks=[compile_, checkpoint], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4))
    assert compile_.compiled == ["net.1", "net.2"]
    assert compiled_blocks(module) == ["net.1", "net.2"]
    assert checkpointed_blocks(module) == ["net.1", "net.2"]
    assert compile_.watch.graphs >= 1  # the compiled blocks ran compiled
    assert "configure_model" not in vars(module)
    assert list(module.state_dict()) == [
        "net.0.weight", "net.0.bias", "net.1.ff.0.weight", "net.1.ff.0.bias",
        "net.2.ff.0.weight", "net.2.ff.0.bias",
    ]  # fmt: skip
