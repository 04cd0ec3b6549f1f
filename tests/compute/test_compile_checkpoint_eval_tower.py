"""RegionalCompile + ActivationCheckpointing on blocks that run their own forward (eval mode,
or ``no_grad``) and break the graph: a frozen Hugging Face vision tower asked for hidden
states. Each compiled block called its checkpoint wrapper again until ``RecursionError``."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import ActivationCheckpointing, RegionalCompile
from lightning_speedkit.compute import compile_blocks
from lightning_speedkit.distributed import checkpoint_blocks
from tests.helpers.fresh_dynamo import fresh_dynamo  # noqa: F401 (autouse)

from .models import Losses, trainer

RTOL = 1e-5  # as the other compile tests: eager and compiled runs agree to this


class Breaking(nn.Module):
    """A block whose forward breaks the graph, as a Hugging Face layer does when its model
    is asked for hidden states (its output-capturing hooks read a ``ContextVar``)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: Tensor) -> Tensor:
        hidden = F.gelu(self.up(x))
        torch._dynamo.graph_break()
        return x + self.down(hidden)


@pytest.mark.parametrize("how", ["eval", "no_grad"])
def test_a_compiled_checkpointed_block_that_breaks_the_graph_runs_its_own_forward(
    how: str,
) -> None:
    """Out of training (eval mode, or ``no_grad``) the wrapper runs the block's forward as
    it is. Compiled, dynamo named that forward ``block.forward``, the wrapper itself, and
    called it at the graph break: the wrapper again, without end."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Breaking() for _ in range(3)])
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = model(x)
    assert compile_blocks(model, backend="eager") == ["0", "1", "2"]
    assert checkpoint_blocks(model) == ["0", "1", "2"]
    if how == "eval":
        model.eval()
        out = model(x)
    else:
        with torch.no_grad():
            out = model(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert sum(counters["graph_break"].values()) >= 1  # the break was reached, compiled


transformers = pytest.importorskip("transformers")

_TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              image_size=32, patch_size=8)  # fmt: skip


class FrozenTower(L.LightningModule):
    """A frozen vision tower kept in eval mode for the fit (docs/frozen-features.md) under a
    trained head; with ``hidden_states`` the head reads the next-to-last layer, as Llava's
    projector does (``vision_feature_layer=-2``)."""

    def __init__(self, family: str, hidden_states: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        if family == "siglip":
            self.tower = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**_TOWER))
        else:
            self.tower = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**_TOWER))
        self.tower.requires_grad_(False)
        self.head = nn.Linear(32, 1)
        self.hidden_states = hidden_states

    def on_train_epoch_start(self) -> None:
        self.tower.eval()

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (images,) = batch
        if self.hidden_states:
            out = self.tower(pixel_values=images, output_hidden_states=True)
            features = out.hidden_states[-2]
        else:
            features = self.tower(pixel_values=images).last_hidden_state
        return self.head(features).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def _images() -> DataLoader[Any]:
    images = torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(images), batch_size=4)


def _fit(family: str, hidden_states: bool, callbacks: list[L.Callback]) -> list[float]:
    losses = Losses()
    trainer(3, [*callbacks, losses]).fit(FrozenTower(family, hidden_states), _images())
    return losses.losses


@pytest.mark.parametrize(
    ("family", "hidden_states"), [("clip", True), ("siglip", True), ("clip", False)]
)
def test_a_frozen_tower_in_eval_mode_trains_with_compiled_checkpointed_layers(
    family: str, hidden_states: bool
) -> None:
    """The fit that failed at its first step (``RecursionError``) when the tower was asked
    for hidden states; without them it ran before, and still does. Losses as the plain run."""
    compile_callback = RegionalCompile(backend="eager", verbose=False)
    checkpoint_callback = ActivationCheckpointing(verbose=False)
    losses = _fit(family, hidden_states, [compile_callback, checkpoint_callback])
    assert len(compile_callback.compiled) == 2  # both encoder layers
    assert checkpoint_callback.checkpointed == compile_callback.compiled
    assert losses == pytest.approx(_fit(family, hidden_states, []), rel=RTOL)


class TrainModeTower(FrozenTower):
    """The frozen tower left in train mode, its attention dropout on (a user who freezes
    weights but not the mode): no gradient passes its layers."""

    def __init__(self) -> None:
        super().__init__("clip", False)
        torch.manual_seed(0)
        config = transformers.CLIPVisionConfig(**_TOWER, attention_dropout=0.1)
        self.tower = transformers.CLIPVisionModel(config).requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        pass


def test_a_frozen_tower_in_train_mode_is_not_checkpointed_under_compile() -> None:
    """A checkpoint no gradient passes is an inference graph once compiled, and AOTAutograd
    refused it: "does not support RNG ops in recompute regions" (the dropout), at the
    first step. Nothing is kept for backward there: the block runs as it is."""

    def fit(callbacks: list[L.Callback]) -> list[float]:
        losses = Losses()
        torch.manual_seed(2)  # the dropout's draws
        trainer(2, [*callbacks, losses]).fit(TrainModeTower(), _images())
        return losses.losses

    compiled = fit([RegionalCompile(backend="aot_eager", verbose=False)])
    checkpoint_callback = ActivationCheckpointing(verbose=False)
    both = fit([RegionalCompile(backend="aot_eager", verbose=False), checkpoint_callback])
    assert len(checkpoint_callback.checkpointed) == 2
    assert both == compiled  # the same compiled layers, run as they are
