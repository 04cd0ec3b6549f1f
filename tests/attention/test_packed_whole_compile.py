"""Packed batches through a model compiled whole with ``torch.compile``.

Compiled as the model (``self.model = torch.compile(self.model)``): the compiled module's
call is an eager module call, so the mode that cuts SDPA per document is open before
dynamo traces the model, and every cut (the swapped attention's and the model's own SDPA
call's) is a graph break that runs eagerly. A new document layout compiles nothing new.

Compiled the Lightning way (``trainer.fit(torch.compile(task))`` compiles
``training_step``): the model's first module call is traced, no mode can be opened there,
and the SDPA calls the model makes itself attend across documents: a warning says so.

``aot_eager`` traces forward and backward as inductor does, without its code generation
(minutes on this CPU); inductor's numbers on packed rows are tested through
RegionalCompile (test_packed_compiled.py).
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap, swap_attention
from lightning_speedkit.data import PackingCollate

from .test_packed_compiled import BATCHES, MAX_TOKENS, Decoder, _samples, _token_losses

#: What dynamo makes of the decoder compiled whole, on the first packed batch: its loop
#: over blocks breaks at the per-document cuts, so the decoder's frame runs eagerly and
#: each block's call is compiled apart (graphs between the cuts).
GRAPHS, BREAKS = 7, 8


class _Task(L.LightningModule):
    def __init__(self, model: nn.Module, compile_model: bool) -> None:
        super().__init__()
        self.initial = copy.deepcopy(model.state_dict())
        self.model = torch.compile(model, backend="aot_eager") if compile_model else model
        self.losses: list[Tensor] = []
        self.graphs: list[tuple[int, int]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        losses = _token_losses(self.model, batch)
        self.losses.append(losses.detach().clone())
        return losses.mean()

    def on_train_batch_end(self, *args: Any) -> None:
        self.graphs.append(
            (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _trainer(steps: int = len(BATCHES)) -> L.Trainer:
    return L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[AttentionSwap(backend="sdpa", verbose=False)])  # fmt: skip


def _loader() -> DataLoader[Any]:
    return DataLoader(_samples(), batch_size=6, collate_fn=PackingCollate(MAX_TOKENS))


def _fit(compile_model: bool) -> _Task:
    torch.manual_seed(0)
    task = _Task(Decoder(), compile_model)
    _trainer().fit(task, _loader())
    return task


def test_a_model_compiled_whole_trains_packed_as_eager_and_compiles_once(
    recwarn: pytest.WarningsRecorder,
) -> None:
    torch._dynamo.reset()
    counters.clear()
    compiled = _fit(compile_model=True)
    eager = _fit(compile_model=False)
    for c, e in zip(compiled.losses, eager.losses, strict=True):
        assert (c - e).abs().max().item() <= 1e-5
    # The first batch compiled every graph; batches whose documents fall elsewhere reuse
    # them (no recompile), the same breaks at each cut.
    assert compiled.graphs == [(GRAPHS, BREAKS)] * len(BATCHES)
    # No document was mixed: the first step's losses are those of each document alone.
    model = Decoder()
    model.load_state_dict(compiled.initial)
    swap_attention(model, "sdpa")
    alone = torch.cat([F.cross_entropy(model(s["input_ids"][None])[0], s["labels"],
                                       reduction="none") for s in _samples()[:6]])  # fmt: skip
    assert (compiled.losses[0] - alone).abs().max().item() <= 1e-5
    assert not [w for w in recwarn if "packed batch" in str(w.message)]


class _Step(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Decoder()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        return _token_losses(self.model, batch).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_compiled_training_step_on_packed_batches_is_named_once() -> None:
    """``trainer.fit(torch.compile(task))``: the rotary attention's own SDPA call mixes."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="torch.compile traced from outside") as record:
        _trainer(steps=2).fit(torch.compile(_Step(), backend="eager"), _loader())
    named = [str(w.message) for w in record if "torch.compile traced" in str(w.message)]
    assert named == [
        "A packed batch ran through a model that torch.compile traced from outside any module "
        "call (`trainer.fit(torch.compile(task))`, a compiled `training_step`): the SDPA calls "
        "that 'model.h.0.rope_attn', 'model.h.1.rope_attn' make themselves (the swap does not "
        "replace them) attend across the documents of a row there. Compile the model instead "
        "(`self.model = torch.compile(self.model)`) or its blocks (`RegionalCompile`)."
    ]
