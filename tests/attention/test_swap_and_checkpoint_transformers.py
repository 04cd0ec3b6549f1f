"""A Hugging Face model swapped and checkpointed: the recomputation runs the fused attention.

The Hugging Face adapter swaps the whole model (``PreTrainedModel``) by switching its
attention implementation for the call; the blocks checkpointed are inside it, and
their recomputation runs in backward, after that call. It ran with the model's own
(eager) attention, a different graph: torch raised ``CheckpointError`` (Llama, BERT),
or the recomputation silently ran eager attention (GPT-2). A checkpoint now replays the
enclosing swap's setting (implementation and SDPA kernel) around its recomputation.
The ``math`` backend shows the kernel is replayed too: replaying the implementation
alone, the recomputation ran the CPU's default SDPA kernel, which saves other tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import lightning as L
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import ActivationCheckpointing, AttentionSwap, swap_attention
from lightning_speedkit.distributed import checkpoint_blocks
from tests.helpers.sdpa_count import CountSdpa

transformers = pytest.importorskip("transformers")

VOCAB, LAYERS = 64, 2


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=LAYERS, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        attn_implementation="eager", bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager",
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


MODELS: dict[str, tuple[Callable[[], nn.Module], list[str]]] = {
    "gpt2": (_gpt2, ["transformer.h.0", "transformer.h.1"]),
    "llama": (_llama, ["model.layers.0", "model.layers.1"]),
    "bert": (_bert, ["bert.encoder.layer.0", "bert.encoder.layer.1"]),
}


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind][0]()


def _ids(seed: int) -> Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def _grads(model: nn.Module, ids: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("order", ["swap_then_checkpoint", "checkpoint_then_swap"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_gradients_equal_the_plain_model_and_the_recomputation_runs_fused(
    kind: str, order: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(kind).train()
    plain = copy.deepcopy(model)
    blocks = MODELS[kind][1]
    if order == "swap_then_checkpoint":
        report = swap_attention(model, backend)
        assert checkpoint_blocks(model) == blocks
    else:
        assert checkpoint_blocks(model) == blocks
        report = swap_attention(model, backend)
    assert report.swapped == [""]
    for step in range(2):  # the first call checks the swap, the second only trains
        loss, grads = _grads(model, _ids(step))
        plain_loss, plain_grads = _grads(plain, _ids(step))
        torch.testing.assert_close(loss, plain_loss, rtol=1e-4, atol=1e-6)
        assert grads.keys() == plain_grads.keys()
        for name in grads:  # within the swap's fp32 tolerance (1e-4 relative)
            torch.testing.assert_close(grads[name], plain_grads[name], rtol=1e-4, atol=1e-5,
                                       msg=f"step {step}: {name}")  # fmt: skip
    assert (report.modules[0].status, report.modules[0].backend) == ("active", backend)
    assert model.config._attn_implementation == "eager"  # switched for the call only
    sdpa = CountSdpa(monkeypatch)
    _grads(model, _ids(5))
    assert (sdpa.forward, sdpa.recomputed) == (LAYERS, LAYERS)


class _Task(L.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.model = _model(kind)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.model(batch[0], labels=batch[0]).loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(kind: str, callbacks: list[L.Callback]) -> _Task:
    task = _Task(kind)
    ids = torch.randint(0, VOCAB, (6, 8), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(task, DataLoader(TensorDataset(ids), batch_size=2))
    return task


@pytest.mark.parametrize("swap_first", [True, False], ids=["swap_first", "checkpoint_first"])
def test_both_callbacks_train_a_hugging_face_model_like_the_plain_run(
    swap_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    swap = AttentionSwap("sdpa", verbose=False)
    checkpointing = ActivationCheckpointing(verbose=False)
    sdpa = CountSdpa(monkeypatch)
    task = _fit("llama", [swap, checkpointing] if swap_first else [checkpointing, swap])
    assert sdpa.recomputed == 3 * LAYERS  # every step's recomputation ran the fused kernel
    monkeypatch.undo()
    plain = _fit("llama", [])
    assert swap.report is not None
    assert swap.report.swapped == ["model"]
    assert swap.report.modules[0].status == "active"
    assert checkpointing.checkpointed == ["model.model.layers.0", "model.model.layers.1"]
    for (name, p), ref in zip(task.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p, ref, rtol=1e-4, atol=1e-5, msg=name)
