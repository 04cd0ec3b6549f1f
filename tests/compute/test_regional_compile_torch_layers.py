"""RegionalCompile on torch's own layers, and what it says when it compiles nothing.

``module.compile()`` of an ``nn.TransformerEncoderLayer`` compiled nothing: dynamo skips
``Module._call_impl`` and the layer's forward alike, both torch's own code
(pytorch/pytorch#150915), and the callback announced the compile, then said "nothing
compiled" at info level. These tests count the frames dynamo compiles, and compare with
the uncompiled layers.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.utils import counters

from lightning_speedkit import RegionalCompile
from lightning_speedkit._blocks import block_candidates
from lightning_speedkit.compute import CompileWatch, compile_blocks
from tests.helpers.fresh_dynamo import fresh_dynamo  # noqa: F401 (autouse)

from .models import loader, trainer

DIM, HEADS, TOKENS = 16, 2, 5


def _encoder(depth: int = 3) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(DIM, HEADS, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)


def _inputs() -> Tensor:
    return torch.randn(2, TOKENS, DIM, generator=torch.Generator().manual_seed(3))


def _run(model: nn.Module, x: Tensor, **kwargs: Any) -> tuple[Tensor, list[Tensor]]:
    """The output and the gradients of the input and of every parameter, after backward."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = model(x, **kwargs)
    out.square().sum().backward()
    assert x.grad is not None
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return out.detach(), [x.grad, *grads]


def _same(got: tuple[Tensor, list[Tensor]], want: tuple[Tensor, list[Tensor]]) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert len(got[1]) == len(want[1])
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_encoder_layers_compile_into_one_graph_equal_to_eager_with_hooks_kept() -> None:
    plain, model = _encoder(), _encoder()
    names = compile_blocks(model, backend="aot_eager")
    assert names == ["layers.0", "layers.1", "layers.2"]
    assert list(model.state_dict()) == list(plain.state_dict())  # no _orig_mod., nothing added
    x, mask = _inputs(), nn.Transformer.generate_square_subsequent_mask(TOKENS)
    watch = CompileWatch().install()
    got = _run(model, x, mask=mask, is_causal=True)
    watch.remove()
    # one frame for the three layers (it was 0: dynamo skipped every frame of them)
    assert dict(counters["frames"]) == {"total": 1, "ok": 1}
    assert not counters["graph_break"]  # the whole layer in that one graph
    assert (watch.graphs, watch.recompiles) == (1, 0)
    # a hook put on one layer after it compiled runs at each call, eagerly, as on any module
    seen: list[int] = []
    model.layers[1].register_forward_hook(lambda module, args, out: seen.append(out.shape[1]))
    again = _run(model, x, mask=mask, is_causal=True)
    assert seen == [TOKENS]
    want = _run(plain, x, mask=mask, is_causal=True)
    _same(got, want)
    torch.testing.assert_close(again[0], want[0], rtol=1e-5, atol=1e-6)


def test_encoder_layers_give_the_same_numbers_in_eval_and_as_copies() -> None:
    plain, model = _encoder(2).eval(), _encoder(2).eval()
    compile_blocks(model, backend="aot_eager")
    x = _inputs()
    with torch.no_grad():  # torch's fast path for inference, inside the compiled frame
        torch.testing.assert_close(model(x), plain(x), rtol=1e-5, atol=1e-6)
    assert counters["frames"]["ok"] >= 1
    # a copy runs the same layer forward, uncompiled (torch keeps no compilation in a copy)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with torch.no_grad():
            torch.testing.assert_close(other(x), plain(x), rtol=1e-5, atol=1e-6)


def test_decoder_layers_compile_into_one_graph_equal_to_eager() -> None:
    def decoder() -> nn.TransformerDecoder:
        torch.manual_seed(0)
        layer = nn.TransformerDecoderLayer(DIM, HEADS, 32, dropout=0.0, batch_first=True)
        return nn.TransformerDecoder(layer, 2)

    plain, model = decoder(), decoder()
    assert compile_blocks(model, backend="aot_eager") == ["layers.0", "layers.1"]
    x, memory = _inputs(), torch.randn(2, 7, DIM, generator=torch.Generator().manual_seed(4))
    got = _run(model, x, memory=memory)
    assert dict(counters["frames"]) == {"total": 1, "ok": 1}
    _same(got, _run(plain, x, memory=memory))


class AttentionBlock(nn.Module):
    """A user's block around torch's ``nn.MultiheadAttention``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.ff = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(x)


def test_user_blocks_holding_multihead_attention_compile_whole_and_equal() -> None:
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(DIM, DIM), *(AttentionBlock() for _ in range(3)))

    plain, compiled = model(), model()
    assert compile_blocks(compiled, backend="aot_eager", fullgraph=True) == ["1", "2", "3"]
    watch = CompileWatch().install()
    got = _run(compiled, _inputs())
    watch.remove()
    assert (watch.graphs, watch.recompiles) == (1, 0)  # fullgraph: one whole graph, or raise
    assert "forward" not in vars(compiled[1])  # its own forward: nothing put on the instance
    _same(got, _run(plain, _inputs()))


# --- the callback ------------------------------------------------------------------------------


class EncoderTask(L.LightningModule):
    """The new user's model: a stock ``nn.TransformerEncoder`` over ``(batch, tokens, DIM)``."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = _encoder(2)
        self.head = nn.Linear(DIM, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.enc(x)).mean(dim=(1, 2)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(model: L.LightningModule, callback: RegionalCompile) -> tuple[list[str], list[str]]:
    """Two steps; the callback's warnings and info lines."""
    said: list[str] = []
    with warnings.catch_warnings(record=True) as caught, pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("always")
        patch.setattr("lightning_speedkit.compute.regional_compile.rank_zero_info", said.append)
        trainer(2, [callback]).fit(model, loader(32))
    warned = [str(w.message) for w in caught if "RegionalCompile" in str(w.message)]
    return warned, said


def test_regional_compile_compiles_a_stock_transformer_encoder() -> None:
    callback = RegionalCompile(backend="aot_eager")
    warned, said = _fit(EncoderTask(), callback)
    assert callback.compiled == ["enc.layers.0", "enc.layers.1"]
    assert counters["frames"]["ok"] >= 1
    assert callback.watch.graphs >= 1
    assert said[-1].startswith("RegionalCompile: compiled "), said  # not "nothing compiled"
    assert warned == []


class SkippedBlock(nn.Module):
    """A block dynamo will not compile (its forward is marked so)."""

    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU())

    @torch.compiler.disable
    def forward(self, x: Tensor) -> Tensor:
        return x + self.ff(x)


class Blocks(L.LightningModule):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(block() for _ in range(3)))
        self.head = nn.Linear(DIM, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.blocks(x)).mean(dim=(1, 2)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_first_step_that_compiled_nothing_warns_naming_the_blocks_and_the_fix() -> None:
    warned, said = _fit(Blocks(SkippedBlock), RegionalCompile(backend="eager"))
    assert counters["frames"]["ok"] == 0
    assert len(warned) == 1, warned  # once, though two steps ran
    assert warned[0].startswith(
        "RegionalCompile: the first training step compiled nothing, so the 3 blocks "
        "(SkippedBlock) ran uncompiled"
    )
    assert 'TORCH_LOGS="+dynamo"' in warned[0]
    assert "`RegionalCompile(blocks=[MyBlock])`" in warned[0]
    assert "`torch.compile(model)`" in warned[0]
    assert not [line for line in said if "nothing compiled" in line]  # a warning, not info


class PlainBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU())

    def forward(self, x: Tensor) -> Tensor:
        return x + self.ff(x)


def test_a_later_fit_that_reuses_compiled_code_does_not_warn() -> None:
    """An earlier fit in the process compiled these block classes: the next one, with a new
    callback and a new model, hits dynamo's cache and compiles nothing, rightly."""
    warned, _ = _fit(Blocks(PlainBlock), RegionalCompile(backend="eager"))
    assert warned == []
    warned, said = _fit(Blocks(PlainBlock), RegionalCompile(backend="eager"))
    assert warned == []
    assert "RegionalCompile: nothing compiled during the first step (the blocks' code" in said[-1]


def test_a_fit_after_dynamo_reset_that_compiles_nothing_warns() -> None:
    """``torch._dynamo.reset()`` drops the code an earlier fit compiled: a later first step
    that compiles nothing (here dynamo made to run everything eagerly) ran the blocks
    uncompiled, and is not told that it reused anything."""
    warned, _ = _fit(Blocks(PlainBlock), RegionalCompile(backend="eager"))
    assert warned == []
    torch._dynamo.reset()
    callback = RegionalCompile(backend="eager")
    with torch.compiler.set_stance("force_eager"):
        warned, said = _fit(Blocks(PlainBlock), callback)
    assert callback.compiled
    assert callback.watch.graphs == 0
    assert len(warned) == 1, warned
    assert warned[0].startswith("RegionalCompile: the first training step compiled nothing")
    assert not [line for line in said if "is reused" in line]


# --- one layer for every layer: no repeated blocks, and what to name -------------------------


class SharedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.ff = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.ff(self.norm(x))


class Albert(L.LightningModule):
    """One layer held once in a ModuleList and called ``depth`` times (as ALBERT's), or
    one layer listed ``depth`` times (``nn.ModuleList([layer] * depth)``)."""

    def __init__(self, listed: bool, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        layer = SharedLayer()
        self.depth = depth
        self.layers = nn.ModuleList([layer] * depth) if listed else nn.ModuleList([layer])
        self.head = nn.Linear(DIM, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        h = self.embed(x)
        for i in range(self.depth):
            h = self.layers[i % len(self.layers)](h)
        return F.mse_loss(self.head(h).mean(dim=(1, 2)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("listed", [False, True], ids=["called-3-times", "listed-3-times"])
def test_no_repeated_blocks_warns_naming_the_class_to_pass(listed: bool) -> None:
    model = Albert(listed)
    callback = RegionalCompile(backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback.setup(trainer(1, [callback]), model, "fit")
    assert callback.compiled == []
    warned = [str(w.message) for w in caught if "RegionalCompile" in str(w.message)]
    assert len(warned) == 1, warned
    assert warned[0].startswith("RegionalCompile: no repeated blocks found in Albert")
    assert "`RegionalCompile(blocks=[SharedLayer])`" in warned[0]
    assert "`nn.ModuleList([layer] * n)`" in warned[0]
    # what it says to do works: the one layer compiles once, and its three calls run that
    assert compile_blocks(model, [SharedLayer], backend="eager") == ["layers.0"]
    x = torch.randn(4, TOKENS, DIM)
    model.training_step((x, torch.randn(4)), 0).backward()
    assert dict(counters["frames"]) == {"total": 1, "ok": 1}


def test_block_candidates_put_a_shared_layer_first_and_never_containers() -> None:
    layer = SharedLayer()
    wrapped = nn.Sequential(AttentionBlock(), nn.ModuleList([layer] * 2))
    assert block_candidates(wrapped) == [SharedLayer, AttentionBlock, nn.MultiheadAttention]
    assert block_candidates(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


class AlbertTask(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.AlbertConfig(
            vocab_size=50, embedding_size=8, hidden_size=DIM, num_hidden_layers=4,
            num_attention_heads=HEADS, intermediate_size=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        torch.manual_seed(0)
        self.albert = transformers.AlbertModel(config)


def test_a_real_albert_is_told_to_name_its_layer_and_that_compiles_once() -> None:
    """transformers' AlbertModel holds one AlbertLayer in a one-entry ModuleList (inside a
    one-entry list of AlbertLayerGroup) and calls it ``num_hidden_layers`` times: "auto"
    finds nothing, and the warning named AlbertEmbeddings first."""
    task = AlbertTask()
    callback = RegionalCompile(backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback.setup(trainer(1, [callback]), task, "fit")
    warned = [str(w.message) for w in caught if "RegionalCompile" in str(w.message)]
    assert len(warned) == 1, warned
    assert (
        "`RegionalCompile(blocks=[AlbertLayer])` (classes that can be blocks here: "
        "AlbertLayer, AlbertLayerGroup, AlbertEmbeddings, AlbertTransformer)" in warned[0]
    )
    model = task.albert
    layer = type(model.encoder.albert_layer_groups[0].albert_layers[0])
    ids = torch.randint(1, 50, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids).last_hidden_state
    assert compile_blocks(model, [layer], backend="eager") == [
        "encoder.albert_layer_groups.0.albert_layers.0"
    ]
    got = model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert dict(counters["frames"]) == {"total": 1, "ok": 1}  # four calls, one graph
