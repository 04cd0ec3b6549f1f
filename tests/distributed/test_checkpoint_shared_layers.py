"""ALBERT-style models under ``blocks="auto"``: one layer instance used for every layer.

``nn.ModuleList([layer] * n)`` is found (each call of the one instance is checkpointed); a
layer held once and called in a loop cannot be seen without running the model, and the
run said only "no repeated blocks found; nothing changed" (``checkpoint_blocks``: nothing).
Now it says which class to pass.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import ActivationCheckpointing
from lightning_speedkit._blocks import repeated_block_types
from lightning_speedkit.distributed import checkpoint_blocks


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.ff = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.ff(self.norm(x))


class Looped(nn.Module):
    """One layer held once, called four times."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.layer = Layer()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for _ in range(4):
            x = self.layer(x)
        return self.head(x).mean()


class Listed(Looped):
    """The same instance four times in a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([self.layer] * 4)
        del self.layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).mean()


def grads(model: nn.Module) -> list[torch.Tensor]:
    torch.manual_seed(1)  # the same dropout masks
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(2))).backward()
    return [p.grad for p in model.parameters() if p.grad is not None]


def test_a_layer_listed_several_times_is_found_and_each_call_recomputed() -> None:
    plain, model = Listed(), Listed()
    assert checkpoint_blocks(model) == ["layers.0"]
    for a, b in zip(grads(plain), grads(model), strict=True):
        assert torch.equal(a, b)
    assert model.layers[0].calls == plain.layers[0].calls == 4  # counted once per call
    # FSDP's wrap policy and regional compilation still leave a shared layer out
    assert repeated_block_types(model) == []
    assert repeated_block_types(model, shared=True) == [Layer]


def test_a_layer_called_in_a_loop_is_not_found_and_the_warning_names_it() -> None:
    with pytest.warns(
        UserWarning, match=r"no repeated blocks found in Looped.*`blocks=\[LayerClass\]`.*: Layer\)"
    ):
        assert checkpoint_blocks(Looped()) == []
    model = Looped()
    assert checkpoint_blocks(model, blocks=[Layer]) == ["layer"]
    for a, b in zip(grads(Looped()), grads(model), strict=True):
        assert torch.equal(a, b)


class _Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Looped()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_callback_says_what_to_pass() -> None:
    callback = ActivationCheckpointing()
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, callbacks=[callback],
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    data = DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4)
    with pytest.warns(UserWarning, match=r"called several times.*: Looped, Layer\)"):
        trainer.fit(_Module(), data)
    assert callback.checkpointed == []
