"""RegionalCompile: blocks compiled in place, same numbers, names kept, compile cost counted."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo import config as dynamo_config
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

from lightning_speedkit import (
    FusedOptimizer,
    RegionalCompile,
    SpeedkitConfigError,
    SpeedMonitor,
    swap_attention,
)
from lightning_speedkit.compute import CompileWatch, compile_blocks, compiled_blocks
from lightning_speedkit.compute import regional_compile as rc
from lightning_speedkit.distributed import checkpoint_blocks, checkpointed_blocks
from tests.helpers.fresh_dynamo import fresh_dynamo  # noqa: F401 (autouse)

from ..helpers.recorder import Recorder
from .models import DIM, Block, Losses, Net, dataset, loader, trainer

RTOL = 1e-5


def test_blocks_compile_in_place_with_their_names_and_keys() -> None:
    plain, model = Net(depth=3), Net(depth=3)
    names = compile_blocks(model, backend="eager")
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    assert compiled_blocks(model) == names
    assert list(model.state_dict()) == list(plain.state_dict())  # no `_orig_mod.` anywhere
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert all(type(b) is Block for b in model.blocks)  # the modules themselves, not wrappers
    x = dataset(8).tensors[0]
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1  # three instances, one compiled graph
    # a checkpoint of the compiled model loads into one that was never compiled
    fresh = Net(depth=3)
    fresh.load_state_dict(copy.deepcopy(model.state_dict()))
    # a second call changes nothing
    assert compile_blocks(model, backend="eager") == names


def test_blocks_can_be_named() -> None:
    model = Net()
    assert compile_blocks(model, ["Block"], backend="eager") == ["blocks.0", "blocks.1"]
    other = Net()
    assert compile_blocks(other, [nn.LayerNorm], backend="eager") == [
        "blocks.0.norm",
        "blocks.1.norm",
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"blocks": "Block"}, r"`blocks` must be \"auto\" or a list.*`blocks=\['Block'\]`"),
        (
            {"blocks": ["Nope"]},
            r"`blocks` names no module class.*'Nope'.*classes are Net, Linear, ModuleList, Block",
        ),
        ({"mode": "fast"}, r"`mode` is not one of the choices, got 'fast'.*'max-autotune'"),
        ({"dynamic": "yes"}, r"`dynamic` is not one of the choices.*None, True, False"),
        ({"fullgraph": 1}, r"`fullgraph` must be True or False, got 1"),
        ({"backend": "inductr"}, r"`backend` is not a torch.compile backend.*`backend='inductor'`"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(SpeedkitConfigError, match=match):
        compile_blocks(Net(), **kwargs)


def test_the_callback_refuses_bad_arguments_at_construction() -> None:
    with pytest.raises(SpeedkitConfigError, match="`mode`"):
        RegionalCompile(mode="fastest")  # type: ignore[arg-type]
    with pytest.raises(SpeedkitConfigError, match="`recompile_warning`"):
        RegionalCompile(recompile_warning=0)


def test_a_model_compiled_whole_is_refused() -> None:
    with pytest.raises(SpeedkitConfigError, match=r"already wrapped by torch\.compile"):
        compile_blocks(torch.compile(Net()))  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_hugging_face_layers_are_found_and_compile(family: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        model: nn.Module = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=2, n_positions=32, vocab_size=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # fmt: skip
        expected = ["transformer.h.0", "transformer.h.1"]
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            vocab_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))  # fmt: skip
        expected = ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    plain = copy.deepcopy(model)
    keys = list(model.state_dict())
    assert compile_blocks(model, backend="aot_eager") == expected
    assert list(model.state_dict()) == keys
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    out = model(ids).logits
    out.sum().backward()
    torch.testing.assert_close(out, plain(ids).logits, rtol=RTOL, atol=1e-6)
    assert counters["stats"]["unique_graphs"] >= 1  # the layers really were traced
    assert dict(counters["graph_break"]) == {}


def test_ten_swapped_and_checkpointed_blocks_share_one_graph() -> None:
    """The attention swap and activation checkpointing put a forward on each module; all
    instances must still share one compiled graph (a callable per instance made dynamo
    compile each one, and stop compiling after eight)."""
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
              for _ in range(10)]  # fmt: skip
    model = nn.Sequential(nn.Linear(16, 16), *layers)
    assert len(swap_attention(model, "sdpa", measure=False).swapped) == 10
    assert len(checkpoint_blocks(model)) == 10
    x = torch.randn(2, 5, 16)
    expected = model(x)
    assert len(compile_blocks(model, backend="eager")) == 10
    watch = CompileWatch().install()
    out = model(x)
    out.sum().backward()
    watch.remove()
    assert (watch.graphs, watch.recompiles) == (1, 0)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


class Lengths(torch.utils.data.Dataset[torch.Tensor]):
    """Batches whose token count changes with every batch (index // batch_size)."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> Any:
        return i


def _ragged(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = 2 + indices[0] // 4  # a new length every batch of 4
    g = torch.Generator().manual_seed(indices[0])
    return torch.randn(len(indices), tokens, 16, generator=g), torch.randn(
        len(indices), generator=g
    )


def test_callback_counts_recompiles_logs_them_and_warns_once() -> None:
    callback = RegionalCompile(dynamic=False, backend="eager", recompile_warning=3, verbose=False)
    recorder = Recorder()
    run = trainer(8, [callback], logger=recorder, log_every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(Net(), DataLoader(Lengths(), batch_size=4, collate_fn=_ragged))
    assert callback.compiled == ["blocks.0", "blocks.1"]
    # one frame (Block.forward) compiled for each of the 8 lengths: 7 of them recompilations
    assert callback.watch.graphs == 8
    assert callback.watch.recompiles == 7
    assert callback.watch.seconds > 0
    ours = [str(w.message) for w in caught if "recompiled" in str(w.message)]
    assert len(ours) == 1
    assert "dynamic=True" in ours[0]
    assert "bucketing" in ours[0]
    assert "packing" in ours[0]
    assert recorder.last("compile/recompiles") == 7
    assert recorder.last("compile/graphs") == 8
    # the callback stops listening when fit ends
    assert callback.watch._installed is False


def test_dynamic_none_stops_recompiling_once_the_length_is_symbolic() -> None:
    callback = RegionalCompile(backend="eager", recompile_warning=3, verbose=False)
    run = trainer(8, [callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(Net(), DataLoader(Lengths(), batch_size=4, collate_fn=_ragged))
    # 8 lengths; after the second, dynamo marks the token dimension symbolic (torch 2.13
    # compiled 3 graphs in all), where dynamic=False compiles all 8 (above)
    assert callback.watch.graphs <= 3
    assert not [w for w in caught if "recompiled" in str(w.message)]


def test_compile_watch_counts_only_while_installed() -> None:
    watch = CompileWatch()
    f = torch.compile(lambda x: x + 1, backend="eager", dynamic=False)
    f(torch.ones(2))
    watch.install()
    f(torch.ones(3))
    watch.remove()
    f(torch.ones(4))
    # one graph, whose frame was first compiled before the watch listened: counted as a
    # graph, not a recompilation (graphs = frames + recompiles); dynamo's own count of the
    # frame's recompilations, which its limit reads, still says 1
    assert (watch.graphs, watch.recompiles) == (1, 0)
    assert watch.most_recompiled == 1


def test_a_second_fit_in_the_process_counts_graphs_and_recompiles_that_add_up() -> None:
    """The frame of ``Block.forward`` was compiled in a first fit; the second fit's first
    compilation of it is dynamo's ``0/1``, but the first this fit saw."""
    model = Net(depth=2)
    compile_blocks(model, backend="eager", dynamic=False)
    x = dataset(4).tensors[0]
    model(x)  # four tokens: the frame compiled once, before the watch
    watch = CompileWatch().install()
    model(x[:, :2])  # two tokens: compiled again, the first compilation this watch sees
    model(x[:, :3])  # three: a recompilation of a frame it saw compiled
    watch.remove()
    assert (watch.graphs, watch.recompiles) == (2, 1)  # it said (2, 2) before
    assert watch.most_recompiled == 2


def test_a_second_fit_with_the_same_callback_reports_its_own_compilations(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A later fit reuses the compiled blocks: it compiled nothing, and says so. Before, it
    printed the first fit's totals as its own ("compiled 1 graph(s) in 1.2 s")."""
    model, callback = Net(depth=2), RegionalCompile(backend="eager", dynamic=False)
    trainer(2, [callback]).fit(model, loader())
    first = callback.watch.snapshot()
    caplog.clear()
    with caplog.at_level("INFO"):
        trainer(2, [callback]).fit(model, loader())
    assert first[0] >= 1
    assert callback.watch.snapshot() == (0, 0, 0.0)
    assert "nothing compiled during the first step" in caplog.text
    assert "compiled 1 graph" not in caplog.text


# --- what "auto" picks: no generic containers, no block inside another ----------------------


class Resnet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv(self.norm(x))


class Down(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([Resnet(), Resnet()])

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return x


class UNetLike(nn.Module):
    """Diffusers' layout: Resnet blocks inside each Down block, and one on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)  # every block's input then needs grad, as in a real model
        self.down = nn.ModuleList([Down(), Down()])
        self.mid = Resnet()

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for block in self.down:
            x = block(x)
        return self.mid(x)


class SequentialNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])


def test_auto_never_takes_a_generic_container_for_a_block() -> None:
    # "Sequential" was the block class: the container and every child compiled, the root too
    stacked = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
    assert compile_blocks(stacked, backend="eager") == []  # was ['', '0', '1', '2']
    assert compile_blocks(SequentialNet(), backend="eager") == []  # was ['net', 'net.0', ...]
    assert checkpoint_blocks(SequentialNet()) == []  # the finder is shared
    # named, Sequential is taken, but the model is never one of its own blocks
    named = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
    assert compile_blocks(named, ["Sequential"], backend="eager") == ["0", "1", "2"]


def test_a_block_inside_another_block_is_not_compiled_or_checkpointed_again() -> None:
    model = UNetLike()
    # the lone `mid` makes Resnet a block class, but the Resnets inside the compiled Down
    # blocks are in their graphs already: compiled again, they were nested regions
    assert compile_blocks(model, backend="eager") == ["down.0", "down.1", "mid"]
    assert compiled_blocks(model) == ["down.0", "down.1", "mid"]  # was 7 modules
    x = torch.randn(2, 8)
    watch = CompileWatch().install()
    model(x).sum().backward()
    watch.remove()
    assert (watch.graphs, watch.recompiles) == (2, 0)  # Down.forward and Resnet.forward
    other = UNetLike()
    assert checkpoint_blocks(other) == ["down.0", "down.1", "mid"]
    assert checkpointed_blocks(other) == ["down.0", "down.1", "mid"]  # none nested


# --- Hugging Face decoders: the KV cache ----------------------------------------------------


def _gpt2(layers: int) -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=layers, n_head=2, n_positions=32, vocab_size=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))  # fmt: skip


class Tokens(torch.utils.data.Dataset[Tensor]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Tensor:
        return torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))


class Decoder(L.LightningModule):
    """A tiny GPT-2 trained on its own tokens; ``use_cache`` passed to its call if set."""

    def __init__(self, layers: int = 4, use_cache: bool | None = None) -> None:
        super().__init__()
        self.model = _gpt2(layers)
        self.use_cache = use_cache

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        kwargs = {} if self.use_cache is None else {"use_cache": self.use_cache}
        return self.model(batch, labels=batch, **kwargs).loss  # type: ignore[no-any-return]

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self.model(batch, labels=batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_hugging_face_decoder_layers_share_one_graph_with_the_cache_off_for_the_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    said: list[str] = []
    monkeypatch.setattr(rc, "rank_zero_info", said.append)
    task = Decoder(layers=4)
    assert task.model.config.use_cache is True  # transformers' default, in training too
    callback = RegionalCompile(backend="aot_eager", recompile_warning=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(2, [callback]).fit(task, DataLoader(Tokens(), batch_size=4))
    assert callback.compiled == [f"model.transformer.h.{i}" for i in range(4)]
    # the cache made every layer compile apart: 4 graphs, 3 recompilations, and past 8
    # layers the rest ran eagerly
    assert (callback.watch.graphs, callback.watch.recompiles) == (1, 0)
    assert counters["stats"]["unique_graphs"] == 1
    assert task.model.config.use_cache is True  # restored when the fit ended
    assert [line for line in said if "use_cache" in line] == [
        "RegionalCompile: `config.use_cache` off for the fit on GPT2LMHeadModel (model), "
        "restored at its end: a KV cache, which the loss does not use, makes each layer "
        "compile a graph of its own"
    ]
    assert not [w for w in caught if "recompiled" in str(w.message)]
    assert not [w for w in caught if "KV cache" in str(w.message)]
    # a validate of the compiled model later: the cache is off for it too (eval mode is
    # a new graph, one for the four layers; with the cache, each layer compiled its own)
    watch = CompileWatch().install()
    trainer(1, [callback], limit_val_batches=1).validate(task, DataLoader(Tokens(), batch_size=4))
    watch.remove()
    assert (watch.graphs, watch.recompiles) == (1, 0)
    assert task.model.config.use_cache is True
    assert said[-1].startswith("RegionalCompile: `config.use_cache` off for the validate on")


def test_compiled_blocks_called_with_a_cache_warn_once_that_each_layer_compiles_apart() -> None:
    model = _gpt2(3)
    assert len(compile_blocks(model, backend="aot_eager")) == 3
    ids = torch.randint(0, 64, (2, 8))
    watch = CompileWatch().install()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(ids, labels=ids).loss.backward()
    watch.remove()
    assert (watch.graphs, watch.recompiles) == (3, 2)  # what the warning is about
    ours = [str(w.message) for w in caught if "KV cache" in str(w.message)]
    assert len(ours) == 1  # once, not once per layer
    assert ours[0].startswith("RegionalCompile: a compiled GPT2Block is called with a KV cache")
    assert "`model.config.use_cache = False`" in ours[0]
    # with the cache off: one graph for the three layers, and no warning
    torch._dynamo.reset()
    fresh = _gpt2(3)
    fresh.config.use_cache = False
    compile_blocks(fresh, backend="aot_eager")
    watch = CompileWatch().install()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh(ids, labels=ids).loss.backward()
    watch.remove()
    assert (watch.graphs, watch.recompiles) == (1, 0)
    assert not [w for w in caught if "KV cache" in str(w.message)]


@pytest.mark.parametrize("dynamic", [None, True])
def test_the_recompile_warning_names_the_cache_when_the_call_passes_one(
    dynamic: bool | None,
) -> None:
    """``use_cache=True`` passed to the call itself: the config is not what turns it on."""
    task = Decoder(layers=4, use_cache=True)
    callback = RegionalCompile(
        backend="aot_eager", dynamic=dynamic, recompile_warning=2, verbose=False
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(1, [callback]).fit(task, DataLoader(Tokens(), batch_size=4))
    assert (callback.watch.graphs, callback.watch.recompiles) == (4, 3)  # one per layer
    ours = [str(w.message) for w in caught if "recompiled" in str(w.message)]
    assert len(ours) == 1
    assert "its calls carry a KV cache" in ours[0]
    assert "use_cache=False" in ours[0]
    assert "RegionalCompile(dynamic=True)" not in ours[0]  # it said: changing batch shapes
    assert "bucketing" not in ours[0]


class Tagged(Block):
    """A block whose forward branches on a string attribute, set anew every step."""

    tag = "0"

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        return out * 2 if self.tag.endswith("0") else out


class TaggedNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Tagged()])  # one: each step compiles it once

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        for block in self.blocks:
            block.tag = str(batch_idx + 1)
        return super().training_step(batch, batch_idx)


def test_the_recompile_warning_does_not_recommend_dynamic_true_when_it_is_set() -> None:
    callback = RegionalCompile(
        ["Tagged"], backend="eager", dynamic=True, recompile_warning=3, verbose=False
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(5, [callback]).fit(TaggedNet(), loader(40, batch_size=8))
    assert (callback.watch.graphs, callback.watch.recompiles) == (5, 4)  # a new tag each step
    ours = [str(w.message) for w in caught if "recompiled" in str(w.message)]
    assert len(ours) == 1
    assert "`dynamic=True` already set" in ours[0]
    assert "TORCH_LOGS=recompiles" in ours[0]
    assert "RegionalCompile(dynamic=True)" not in ours[0]
    assert "KV cache" not in ours[0]


@pytest.mark.slow
def test_inductor_blocks_with_fused_adamw_match_the_plain_run() -> None:
    """The one test that generates code (inductor, C++ on CPU): about 20-60 s of compiling."""
    torch.set_num_threads(1)
    plain_losses, fast_losses = Losses(), Losses()
    plain_monitor, fast_monitor = SpeedMonitor(peak_flops=None), SpeedMonitor(peak_flops=None)
    plain_model, fast_model = Net(), Net()
    trainer(4, [plain_losses, plain_monitor]).fit(plain_model, loader())
    compile_callback = RegionalCompile(fullgraph=True, verbose=False)
    fast = trainer(4, [compile_callback, FusedOptimizer(verbose=False), fast_losses, fast_monitor])
    fast.fit(fast_model, loader())
    assert compile_callback.compiled == ["blocks.0", "blocks.1"]
    assert counters["stats"]["unique_graphs"] == 1
    assert dict(counters["graph_break"]) == {}
    assert compile_callback.watch.recompiles == 0
    assert fast_losses.losses == pytest.approx(plain_losses.losses, rel=RTOL)
    with torch.no_grad():
        for p, q in zip(fast_model.parameters(), plain_model.parameters(), strict=True):
            assert float((p - q).norm() / q.norm()) <= RTOL
    # FLOPs are still counted on the compiled model: the same count as the plain run's
    assert fast_monitor.summary["flops_per_sample"] == plain_monitor.summary["flops_per_sample"]
    assert fast_monitor.summary["flops_per_sample"] > 0
    # and the checkpoint's weights load into the plain model by the same names
    plain_model.load_state_dict(fast_model.state_dict())


# --- a model compiled already; a recompile warning that says what changed ---------------------


def test_a_lightning_module_passed_compiled_is_refused_with_the_fix() -> None:
    """``trainer.fit(torch.compile(model))``: Lightning compiles the steps; blocks compiled
    inside them again made dynamo fail (torch 2.13) or recompile call after call."""
    callback = RegionalCompile(backend="eager", verbose=False)
    with pytest.raises(SpeedkitConfigError) as error:
        trainer(2, [callback]).fit(torch.compile(Net(), backend="eager"), loader())
    message = str(error.value)
    assert "Lightning already compiles" in message
    assert "`trainer.fit(model)`" in message
    assert "remove RegionalCompile" in message
    assert callback.compiled == []


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Tower(Net):
    """Blocks of its own, and an encoder of other blocks that the user compiled."""

    def __init__(self, how: str) -> None:
        super().__init__(depth=2)
        self.encoder = Encoder()
        if how == "wrapped":
            self.encoder = torch.compile(self.encoder, backend="eager")  # type: ignore[assignment]
        elif how == "in_place":
            self.encoder.compile(backend="eager")
        elif how == "each":
            self.blocks = nn.ModuleList(torch.compile(b, backend="eager") for b in self.blocks)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(self.encoder(x))


@pytest.mark.parametrize(
    ("how", "named"),
    [("wrapped", "`encoder._orig_mod.blocks.0` in `encoder`, which is compiled already "
                 "(torch.compile(...))"),
     ("in_place", "`encoder.blocks.0` in `encoder`, which is compiled already (module.compile())"),
     ("each", "the block `blocks.0`, which is compiled already (torch.compile(...))")],
)  # fmt: skip
def test_blocks_inside_a_compiled_submodule_are_refused_with_the_fix(how: str, named: str) -> None:
    with pytest.raises(SpeedkitConfigError) as error:
        compile_blocks(Tower(how), backend="eager")
    assert named in str(error.value)
    assert "name blocks outside it (`blocks=[...]`)" in str(error.value)
    callback = RegionalCompile(backend="eager", verbose=False)
    with pytest.raises(SpeedkitConfigError, match="compiled already"):
        trainer(2, [callback]).fit(Tower(how), loader())


def test_blocks_outside_a_compiled_submodule_still_compile() -> None:
    class Outer(Block):
        """The model's own blocks, another class than the encoder's."""

    model = Tower("wrapped")
    model.blocks = nn.ModuleList(Outer() for _ in range(2))
    assert compile_blocks(model, ["Outer"], backend="eager") == ["blocks.0", "blocks.1"]


def test_the_recompile_warning_names_the_guard_when_shapes_do_not_change() -> None:
    """Constant shapes, a string attribute new every step: not a shape problem."""
    callback = RegionalCompile(["Tagged"], backend="eager", recompile_warning=3, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(5, [callback]).fit(TaggedNet(), loader(40, batch_size=8))
    assert (callback.watch.graphs, callback.watch.recompiles) == (5, 4)
    ours = [str(w.message) for w in caught if "recompiled" in str(w.message)]
    assert len(ours) == 1
    assert "not because a shape changes" in ours[0]
    assert "dynamo's last reason is `0/2: " in ours[0]
    assert ".tag" in ours[0]  # the guard on the attribute, as dynamo wrote it
    assert "shapes keep changing" not in ours[0]
    assert "dynamic=True" not in ours[0]
    assert "bucketing" not in ours[0]


def test_the_shape_warning_quotes_the_size_guard() -> None:
    callback = RegionalCompile(dynamic=False, backend="eager", recompile_warning=3, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(4, [callback]).fit(Net(), DataLoader(Lengths(), batch_size=4, collate_fn=_ragged))
    ours = [str(w.message) for w in caught if "recompiled" in str(w.message)]
    assert len(ours) == 1
    assert "batch shapes keep changing" in ours[0]
    assert "size mismatch at index 1. expected 4, actual 5" in ours[0]


# --- with the attention swap's ``auto`` ------------------------------------------------------


def test_auto_swapped_blocks_of_one_class_compile_to_one_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On an H200 `auto`'s per-module timing gave the VLM's 28 blocks four backends; each
    # was one more graph of the block's forward, and past dynamo's limit of 8 the rest
    # ran uncompiled. Here the timing is rigged to differ on every call.
    from lightning_speedkit import swap_attention
    from lightning_speedkit.attention import _swapped_forward
    from speedkit_examples.vlm import VLM, VLMConfig

    timed: list[str] = []

    def fake_pick(own: Any, passing: Any, **_: Any) -> tuple[str, float, float]:
        backend, error, _run = passing[len(timed) % len(passing)]
        timed.append(backend)
        return backend, error, 2.0

    monkeypatch.setattr(_swapped_forward, "pick_fastest", fake_pick)
    torch.manual_seed(0)
    model = VLM(VLMConfig.preset("tiny", vocab_size=35))
    images, ids = torch.randn(2, 3, 32, 32), torch.randint(0, 35, (2, 12))
    swap_attention(model, "auto")
    model(images, ids).sum().backward()  # each swapped module's check, eagerly
    compile_blocks(model, backend="eager")
    watch = CompileWatch().install()
    model(images, ids).sum().backward()
    model(images, ids).sum().backward()
    watch.remove()
    assert (watch.graphs, watch.recompiles) == (2, 0)  # one per block class
    assert len(timed) == 2  # auto timed once per attention class


# --- dynamo's recompile limit; instances whose shapes differ by their place ------------------


class Widen(nn.Module):
    """A block whose instances widen the features: each has its own parameter shapes, as
    a UNet's ResnetBlock2D has its own channel counts."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width + 4)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x))


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDEST)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.norm(x)


class Shift(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Linear(WIDEST, WIDEST)

    def forward(self, x: Tensor) -> Tensor:
        return self.shift(x) - x


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDEST, WIDEST)

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(self.gate(x))


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(WIDEST, WIDEST)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mix(x)


WIDTHS = [8 + 4 * i for i in range(9)]  # nine Widen blocks, nine parameter shapes
WIDEST = WIDTHS[-1] + 4


class FiveKinds(L.LightningModule):
    """Five block classes; Widen's nine instances need nine graphs, one past dynamo's 8."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.widen = nn.ModuleList(Widen(width) for width in WIDTHS)
        self.tail = nn.ModuleList(kind() for kind in (Norm, Norm, Shift, Shift))
        self.more = nn.ModuleList(kind() for kind in (Gate, Gate, Mix, Mix))
        self.head = nn.Linear(WIDEST, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        for block in [*self.widen, *self.tail, *self.more]:
            x = block(x)
        return F.mse_loss(self.head(x).squeeze(1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _vectors(width: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(2)
    return DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, width, generator=g), torch.randn(8)),
        batch_size=4,
    )


@pytest.fixture
def no_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The callback's CompileWatch reads a clock that never moves: the warning's seconds
    are 0.0, so the test can compare its whole text."""
    monkeypatch.setattr(rc, "CompileWatch", lambda: CompileWatch(clock=lambda: 0.0))


def test_a_block_at_dynamos_limit_warns_with_five_block_classes(no_clock: None) -> None:
    """With five block classes the threshold was 4 + 5 - 1 = 8 recompilations, which one
    function never reaches (8 graphs, 7 recompilations, is dynamo's limit): the last Widen
    block ran uncompiled and nothing was said. Now the threshold stops at the limit less one."""
    callback = RegionalCompile(backend="eager", verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(1, [callback]).fit(FiveKinds(), _vectors(WIDTHS[0]))
    assert [kind.__name__ for kind in callback._kinds] == ["Gate", "Mix", "Norm", "Shift", "Widen"]
    assert callback.watch.most_recompiled == 7  # 8 graphs of Widen.forward; the 9th ran eagerly
    assert callback.watch.graphs == 12  # and one graph for each of the other four classes
    ours = [str(w.message) for w in caught if "recompiled" in str(w.message)]
    assert ours == [
        "RegionalCompile: Widen's compiled forward recompiled 7 times (7 recompilations, 0.0 s "
        "compiling so far) (dynamo's last reason: `0/6: tensor 'x' size mismatch at index 1. "
        "expected 32, actual 36`): its 9 instances have 9 different parameter shapes (channel "
        "counts that change with the place in the network), and dynamo compiles a graph for "
        "each: it keeps parameter shapes static, so neither `dynamic=True` nor fewer batch "
        "shapes helps; it now holds 8 graphs, dynamo's limit per function "
        "(`torch._dynamo.config.recompile_limit`): from now on its calls that fit none of them "
        "run uncompiled (instances not compiled yet, a new shape). Let dynamo keep more graphs, "
        "one or two per parameter shape: `torch._dynamo.config.recompile_limit = 18` before "
        "the fit; or compile only blocks whose instances share their shapes: "
        "`RegionalCompile(blocks=[Gate, Mix, Norm, Shift])` leaves Widen out."
    ]


def test_the_raised_limit_the_warning_names_compiles_every_instance(no_clock: None) -> None:
    """The fix the warning gives works: with dynamo keeping 18 graphs, all nine compile,
    and the warning, at ``recompile_warning`` recompilations, says the limit has room."""
    callback = RegionalCompile(["Widen"], backend="eager", verbose=False)
    with warnings.catch_warnings(record=True) as caught, dynamo_config.patch(recompile_limit=18):
        warnings.simplefilter("always")
        trainer(2, [callback]).fit(FiveKinds(), _vectors(WIDTHS[0]))
    assert callback.watch.most_recompiled == 8  # nine graphs, one per instance; then reused
    assert callback.watch.graphs == 9
    ours = [str(w.message) for w in caught if "recompiled" in str(w.message)]
    assert ours == [
        "RegionalCompile: Widen's compiled forward recompiled 8 times (8 recompilations, 0.0 s "
        "compiling so far) (dynamo's last reason: `0/7: tensor 'x' size mismatch at index 1. "
        "expected 36, actual 40`): its 9 instances have 9 different parameter shapes (channel "
        "counts that change with the place in the network), and dynamo compiles a graph for "
        "each: it keeps parameter shapes static, so neither `dynamic=True` nor fewer batch "
        "shapes helps; past dynamo's limit (18) it runs uncompiled. dynamo's limit (18) has "
        "room for one or two graphs per parameter shape; or compile only blocks whose "
        "instances share their shapes: name a class that holds the Widen blocks in "
        "`RegionalCompile(blocks=[...])`."
    ]


def test_the_threshold_follows_the_recompile_limit_torch_has_now(no_clock: None) -> None:
    """A recompile limit of 4 (read at each check, not the default 8): a threshold of 4
    recompilations was never reached, and the run went on uncompiled in silence."""
    callback = RegionalCompile(dynamic=False, backend="eager", verbose=False)
    with warnings.catch_warnings(record=True) as caught, dynamo_config.patch(recompile_limit=4):
        warnings.simplefilter("always")
        trainer(6, [callback]).fit(Net(), DataLoader(Lengths(), batch_size=4, collate_fn=_ragged))
    assert callback.watch.most_recompiled == 3  # 4 lengths compiled, the next two ran eagerly
    ours = [str(w.message) for w in caught if "recompiled" in str(w.message)]
    assert ours == [
        "RegionalCompile: Block's compiled forward recompiled 3 times (3 recompilations, 0.0 s "
        "compiling so far) (dynamo's last reason: `0/2: tensor 'x' size mismatch at index 1. "
        "expected 4, actual 5`): batch shapes keep changing; it now holds 4 graphs, dynamo's "
        "limit per function (`torch._dynamo.config.recompile_limit`): from now on its calls "
        "that fit none of them run uncompiled (instances not compiled yet, a new shape). "
        "Compile for symbolic shapes with `RegionalCompile(dynamic=True)`, or give batches "
        "fewer distinct shapes: length bucketing or sequence packing (SpeedDataModuleMixin's "
        "`lengths=` or PackingCollate). `TORCH_LOGS=recompiles` shows the guard that fails."
    ]


class Halve(nn.Module):
    """The same parameters in every instance; each halves the tokens, so each instance's
    input is half as long as the one before (a UNet's resolutions, by position)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x.unflatten(1, (-1, 2)).mean(2))  # a view, as its input: one guard


class Halving(Net):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Halve() for _ in range(4))  # 32 tokens in, 2 out


def _long(n: int = 16) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(n, 32, DIM, generator=g), torch.randn(n))
    return DataLoader(data, batch_size=4)


@pytest.mark.parametrize(("dynamic", "graphs"), [(False, 4), (True, 1)])
def test_input_shapes_that_differ_by_position_are_not_blamed_on_the_batches(
    no_clock: None, dynamic: bool, graphs: int
) -> None:
    """Every batch alike, the recompilations all in the first step: the advice said "batch
    shapes keep changing" and offered bucketing. Now it names the position in the network,
    and its fix (``dynamic=True``) gives one graph."""
    callback = RegionalCompile(dynamic=dynamic, backend="eager", recompile_warning=3, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(2, [callback]).fit(Halving(), _long())
    assert callback.watch.graphs == graphs  # and the second step compiled nothing
    ours = [str(w.message) for w in caught if "recompiled" in str(w.message)]
    if dynamic:
        assert ours == []
        return
    assert ours == [
        "RegionalCompile: Halve's compiled forward recompiled 3 times (3 recompilations, 0.0 s "
        "compiling so far) (dynamo's last reason: `0/2: tensor 'x' size mismatch at index 1. "
        "expected 8, actual 4`): all within the first step, so not because batch shapes "
        "change: its instances get inputs of different shapes by their place in the network "
        "(a UNet's resolutions); past dynamo's limit (8) it runs uncompiled. Compile for "
        "symbolic shapes with `RegionalCompile(dynamic=True)`: one graph then serves them "
        "all. Length bucketing or sequence packing would not help."
    ]
