"""transformers' own gradient checkpointing on a Hugging Face model the kit swapped.

``model.gradient_checkpointing_enable()`` checkpoints each layer with transformers' own
checkpoint function; its recomputation runs in backward, after the swap's call put the
model's attention implementation (``eager``) back. It ran eager attention, without the
causal mask transformers leaves out for SDPA: ``use_reentrant=False`` raised
``CheckpointError``, ``use_reentrant=True`` silently gave other gradients (Qwen2: 0.73
relative) or, on BERT, recomputed unfused. While the swap's setting is on, the layers'
checkpoint functions now recompute under it, whenever checkpointing was enabled.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import AttentionSwap, packed_documents, swap_attention
from lightning_speedkit.data import PackingCollate
from lightning_speedkit.distributed import checkpoint_blocks
from lightning_speedkit.errors import SpeedkitConfigError
from tests.helpers.hf_tiny import tiny_model
from tests.helpers.sdpa_count import CountSdpa, assert_equal_grads

transformers = pytest.importorskip("transformers")
# The name the user's report called (transformers 5 calls it a deprecated alias).
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable`:FutureWarning")

VOCAB, LAYERS, SEQ = 64, 2, 16


_qwen2 = tiny_model(
    "Qwen2Config", "Qwen2ForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
    num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=32, use_cache=False, attn_implementation="eager",
)  # fmt: skip
_bert = tiny_model(
    "BertConfig", "BertForMaskedLM", vocab_size=VOCAB, hidden_size=32,
    num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=32, attn_implementation="eager",
)  # fmt: skip


MODELS: dict[str, Callable[[], nn.Module]] = {"qwen2": _qwen2, "bert": _bert}


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind]().train()


def _hf_checkpointing(model: Any, reentrant: bool) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


def _ids(seed: int) -> Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _grads(model: nn.Module, ids: Tensor) -> Tensor:
    """The whole model's gradient, one vector."""
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _checkpoint_functions(model: nn.Module) -> list[Any]:
    return [m.__dict__.get("_gradient_checkpointing_func") for m in model.modules()]


@pytest.mark.parametrize("enabled", ["before_swap", "after_swap"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_swapped_model_recomputes_fused_with_the_plain_gradients(
    kind: str, reentrant: bool, enabled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(kind)
    unchecked = copy.deepcopy(model)  # neither swapped nor checkpointed
    plain = copy.deepcopy(model)  # checkpointed by transformers, not swapped
    _hf_checkpointing(plain, reentrant)
    if enabled == "before_swap":
        _hf_checkpointing(model, reentrant)
        report = swap_attention(model, "sdpa", measure=False)
    else:  # enabled once the swap is installed: covered from the next call
        report = swap_attention(model, "sdpa", measure=False)
        _hf_checkpointing(model, reentrant)
    assert report.swapped == [""]
    functions = _checkpoint_functions(model)
    assert sum(f is not None for f in functions) >= LAYERS
    for step in range(2):  # the first call checks the swap, the second only trains
        grads = _grads(model, _ids(step))
        assert_equal_grads(grads, _grads(plain, _ids(step)), f"step {step} vs checkpointed")
        assert_equal_grads(grads, _grads(unchecked, _ids(step)), f"step {step} vs unchecked")
    sdpa = CountSdpa(monkeypatch)
    _grads(model, _ids(2))
    assert (sdpa.forward, sdpa.recomputed) == (LAYERS, LAYERS)  # the recomputation is fused
    # Nothing of the kit stays on the model: transformers' own functions, as it set them.
    assert _checkpoint_functions(model) == functions
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_kit_checkpointing_and_transformers_checkpointing_both_on(reentrant: bool) -> None:
    model = _model("qwen2")
    plain = copy.deepcopy(model)
    _hf_checkpointing(model, reentrant)
    swap_attention(model, "sdpa", measure=False)
    assert checkpoint_blocks(model) == ["model.layers.0", "model.layers.1"]
    for step in range(2):
        assert_equal_grads(_grads(model, _ids(step)), _grads(plain, _ids(step)), f"step {step}")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_packed_batch_recomputes_each_document_apart(reentrant: bool) -> None:
    """The backward runs after ``packed_documents`` ended: the recomputation replays the
    batch's documents too (it ran over whole rows: 0.35 relative gradient error)."""
    docs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n))
            for n in (5, 3, 7, 4)]  # fmt: skip
    samples = [{"input_ids": d, "labels": d} for d in docs]
    batch = PackingCollate(max_tokens=10, separate_documents=True)(samples)
    fields = {f: batch[f] for f in ("input_ids", "position_ids", "labels")}
    model = _model("qwen2")
    plain = copy.deepcopy(model)
    grads = []
    for m, checkpointed in ((model, True), (plain, False)):
        if checkpointed:
            _hf_checkpointing(m, reentrant)
        swap_attention(m, "sdpa", measure=False)
        with packed_documents(batch):
            loss = m(**fields).loss
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert_equal_grads(grads[0], grads[1], "packed")


class _Task(L.LightningModule):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.model = _model("qwen2")
        if reentrant is not None:
            _hf_checkpointing(self.model, reentrant)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.model(batch[0], labels=batch[0]).loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(reentrant: bool | None, callbacks: list[L.Callback]) -> _Task:
    task = _Task(reentrant)
    ids = torch.randint(0, VOCAB, (6, SEQ), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(task, DataLoader(TensorDataset(ids), batch_size=2))
    return task


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_attention_swap_trains_a_checkpointed_model_like_the_plain_run(
    reentrant: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    swap = AttentionSwap("sdpa", measure=False, verbose=False)
    sdpa = CountSdpa(monkeypatch)
    task = _fit(reentrant, [swap])
    assert sdpa.recomputed == 3 * LAYERS  # every step's recomputation ran the fused kernel
    monkeypatch.undo()
    assert swap.report is not None
    assert (swap.report.swapped, swap.report.modules[0].status) == (["model"], "active")
    for plain in (_fit(reentrant, []), _fit(None, [])):  # checkpointed, and not
        for (name, p), ref in zip(task.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6, msg=name)


def test_layers_that_checkpoint_by_their_own_code_are_refused_with_the_fix() -> None:
    """transformers' format from before 4.35 (a model's remote code): the layers have the
    flag but checkpoint by the model's own code, which the swap cannot reach."""
    model = _model("qwen2")
    _hf_checkpointing(model, reentrant=False)
    swap_attention(model, "sdpa", measure=False)
    for module in model.modules():
        module.__dict__.pop("_gradient_checkpointing_func", None)
    with torch.no_grad():  # nothing is recomputed: the swap runs
        model(_ids(0))
    with pytest.raises(SpeedkitConfigError, match="use the kit's `ActivationCheckpointing`"):
        model(_ids(0))


class _CountWalks:
    """Counts the walks of ``model``'s whole tree from the root (``modules()`` and
    ``parameters()`` walk ``named_modules()``; finding the first parameter is no walk)."""

    def __init__(self, model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
        self.walks, self._walk = 0, model.named_modules
        monkeypatch.setattr(model, "named_modules", self)

    def __call__(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        yield from self._walk(*args, **kwargs)
        self.walks += 1


@pytest.mark.parametrize("checkpointing", ["none", "kit", "transformers", "both"])
def test_the_model_is_not_walked_on_every_call(
    checkpointing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swap's setting is entered on each call and on each replay of the kit's
    checkpoint (one per block): it walked all 423 modules of a 32-layer Qwen2 each time,
    33 walks (16 ms) a step with ``checkpoint_blocks``, checkpointing by transformers on or
    not. The layers that can checkpoint are learned once."""
    model = _model("qwen2")
    if checkpointing in ("transformers", "both"):
        _hf_checkpointing(model, reentrant=False)
    swap_attention(model, "sdpa", measure=False)
    if checkpointing in ("kit", "both"):
        assert checkpoint_blocks(model) == ["model.layers.0", "model.layers.1"]
    plain = copy.deepcopy(model)
    count = _CountWalks(model, monkeypatch)
    walks = []
    for step in range(3):  # the first call checks the swap (and the layers are learned)
        count.walks = 0
        model(_ids(step), labels=_ids(step)).loss.backward()
        walks.append(count.walks)
    assert walks[1:] == [0, 0], walks  # was 1 a step, 3 with the kit's checkpointing
    assert_equal_grads(_grads(model, _ids(3)), _grads(plain, _ids(3)), "after the steps")


@pytest.mark.parametrize("change", ["enabled", "layer_replaced", "layer_inserted"])
def test_checkpointing_changed_after_swapped_calls_is_seen(
    change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What was learned on the first calls is not trusted once it may be stale: layers
    whose checkpointing is enabled later, a layer replaced (a module registered) or
    inserted (``nn.ModuleList.insert`` registers none)."""
    model = _model("qwen2")
    plain = copy.deepcopy(model)  # checkpointed by transformers, not swapped
    _hf_checkpointing(plain, reentrant=False)
    if change != "enabled":
        _hf_checkpointing(model, reentrant=False)
    swap_attention(model, "sdpa", measure=False)
    for step in range(3):
        _grads(model, _ids(step))
    layers = LAYERS
    if change == "enabled":
        _hf_checkpointing(model, reentrant=False)
    for m in (model, plain) if change != "enabled" else ():
        added = copy.deepcopy(m.model.layers[1], {id(m.config): m.config})  # one config
        if change == "layer_replaced":
            m.model.layers[1] = added
        else:
            m.model.layers.insert(0, added)
            m.config.num_hidden_layers += 1
            m.config.layer_types.append(m.config.layer_types[-1])
    layers += change == "layer_inserted"
    sdpa = CountSdpa(monkeypatch)
    grads = _grads(model, _ids(3))
    assert (sdpa.forward, sdpa.recomputed) == (layers, layers)  # every layer recomputed fused
    monkeypatch.undo()
    assert_equal_grads(grads, _grads(plain, _ids(3)), change)
