"""One layer instance used for every layer, under ``blocks="auto"``.

One layer listed n times (``nn.ModuleList([layer] * n)``) is found (each call of the one
instance is checkpointed). A layer held once and called in a loop (ALBERT's, in
transformers: a one-entry ``ModuleList`` called ``num_hidden_layers`` times) cannot be
seen without running the model, and the run said only "no repeated blocks found; nothing
changed" (``checkpoint_blocks``: nothing); then a placeholder ``blocks=[LayerClass]``,
naming the embeddings first for a real ALBERT. Now it names the looped layer's class.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import ActivationCheckpointing
from lightning_speedkit._blocks import repeated_block_types
from lightning_speedkit.distributed import checkpoint_blocks, saved_tensor_bytes


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
        UserWarning, match=r"no repeated blocks found in Looped.*`blocks=\[Layer\]`.*: Layer\)\.$"
    ):
        assert checkpoint_blocks(Looped()) == []
    with pytest.warns(UserWarning, match=r"no block to checkpoint: remove Activation"):
        assert checkpoint_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []
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
    # the looped layer first; the network that holds it, inside the LightningModule, last
    with pytest.warns(UserWarning, match=r"in a loop.*`blocks=\[Layer\]`.*: Layer, Looped\)"):
        trainer.fit(_Module(), data)
    assert callback.checkpointed == []


def test_a_real_albert_gets_its_layer_named_and_checkpointed() -> None:
    """transformers' AlbertModel keeps one AlbertLayer in a one-entry ModuleList (inside a
    one-entry list of AlbertLayerGroup) and calls it num_hidden_layers times."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AlbertConfig(
        vocab_size=50, embedding_size=8, hidden_size=16, num_hidden_layers=4,
        num_attention_heads=2, intermediate_size=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = transformers.AlbertModel(config)
    model = transformers.AlbertModel(config)
    model.load_state_dict(plain.state_dict())
    with pytest.warns(UserWarning, match=r"`blocks=\[AlbertLayer\]` \(classes .*: AlbertLayer, "):
        assert checkpoint_blocks(model) == []
    layer = type(model.encoder.albert_layer_groups[0].albert_layers[0])
    assert checkpoint_blocks(model, [layer]) == ["encoder.albert_layer_groups.0.albert_layers.0"]
    ids = torch.randint(1, 50, (2, 12), generator=torch.Generator().manual_seed(1))

    def output(albert: nn.Module) -> torch.Tensor:
        return albert(input_ids=ids).last_hidden_state.square().sum()

    output(plain).backward()
    output(model).backward()
    for a, b in zip(plain.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    # each of the four calls keeps only its input for backward
    checkpointed, whole = saved_tensor_bytes(output, model), saved_tensor_bytes(output, plain)
    assert checkpointed < whole / 2, (checkpointed, whole)
