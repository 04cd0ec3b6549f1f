"""The three compute levers with every other callback on the example VLM, in any order, resumed.

RegionalCompile runs with ``fullgraph=True`` (a graph break anywhere in a block, from
the attention swap, activation checkpointing, or a host sync such as ``.item()``,
raises) and the ``aot_eager`` backend: dynamo traces and AOTAutograd builds the
joint graph exactly as for inductor, without minutes of C++ code generation on two
cores (the inductor numbers are checked on a smaller model in test_regional_compile).
MicroBatchTuner's timing is injected so that its choice is known: 8 from a loader of 4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch._dynamo.utils import counters
from torch.utils.data import DataLoader

from lightning_speedkit import (
    AccumulationScheduler,
    ActivationCheckpointing,
    AttentionSwap,
    FusedOptimizer,
    MicroBatchTuner,
    NumWorkersTuner,
    ProfilerSchedule,
    RegionalCompile,
    SpeedMonitor,
)
from lightning_speedkit.compute import StepMeasurement
from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule, VLMTask

from ..conftest import SMALL_CORPUS

GIVEN, MICRO, GLOBAL, EPOCH_BATCHES = 4, 8, 16, 4  # two optimizer steps per epoch


class InOrder(VLMDataModule):
    """The example's data without shuffling, so a resumed epoch sees the same batches."""

    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader("train", shuffle=False)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.sizes: set[int] = set()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any,
                           batch: Any, batch_idx: int) -> None:  # fmt: skip
        self.losses[trainer.current_epoch * EPOCH_BATCHES + batch_idx] = float(outputs["loss"])
        self.sizes.add(int(batch["input_ids"].shape[0]))
        self.accumulation = trainer.accumulate_grad_batches


class Timing:
    """MicroBatchTuner's measure: 8 is the fastest per sample. Records what it timed."""

    def __init__(self) -> None:
        self.timed: list[int] = []

    def __call__(self, run: Any, n: int) -> StepMeasurement:
        run()
        self.timed.append(n)
        return StepMeasurement({1: 0.01, 2: 0.015, 4: 0.02, 8: 0.025, 16: 0.09}[n])


def callbacks(tmp_path: Path, timing: Timing, order: int) -> list[L.Callback]:
    chosen: list[L.Callback] = [
        SpeedMonitor(warmup_steps=1, log_every_n_steps=2),
        NumWorkersTuner(progress=False, batches=4, warmup_batches=1, cache=False, verdict_steps=0),
        AttentionSwap(backend="sdpa", verbose=False),
        AccumulationScheduler(target_global_batch=GLOBAL, verbose=False),
        ActivationCheckpointing(verbose=False),
        ProfilerSchedule(
            skip_first=1,
            wait=0,
            warmup=1,
            active=1,
            repeat=1,
            dirpath=tmp_path / "profiler",
            with_stack=False,
        ),
        RegionalCompile(backend="aot_eager", fullgraph=True, verbose=False),
        FusedOptimizer(verbose=False),
        MicroBatchTuner(measure=timing, verbose=False),
    ]
    if order:  # another order of the same callbacks
        chosen = chosen[order:] + chosen[:order]
        chosen.reverse()
    return [*chosen, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2,
                                     save_top_k=-1), Losses()]  # fmt: skip


def fit(corpus: Path, tmp_path: Path, steps: int, order: int, ckpt: Path | None = None) -> Any:
    torch.manual_seed(0)
    tokenizer = CaptionTokenizer()
    config = VLMConfig.preset("tiny", tokenizer.vocab_size)
    data = InOrder.for_model(config, str(corpus), batch_size=GIVEN, corpus=SMALL_CORPUS,
                             progress=False)  # fmt: skip
    timing = Timing()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps,
        limit_train_batches=EPOCH_BATCHES * MICRO // GIVEN,  # in batches of GIVEN: 32 samples
        limit_val_batches=0, logger=False, callbacks=callbacks(tmp_path, timing, order),
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    breaks_before = sum(counters["graph_break"].values())
    trainer.fit(VLMTask(config, pad_id=tokenizer.pad_id), datamodule=data, ckpt_path=ckpt)
    return trainer, timing, sum(counters["graph_break"].values()) - breaks_before


def _callback(trainer: L.Trainer, kind: type[L.Callback]) -> Any:
    return next(c for c in trainer.callbacks if isinstance(c, kind))  # type: ignore[attr-defined]


@pytest.mark.slow
def test_all_callbacks_with_the_compute_levers_train_in_any_order_and_resume_exactly(
    small_corpus: Path, tmp_path: Path
) -> None:
    torch._dynamo.reset()  # compiled from nothing: the graphs counted below are this run's
    counters.clear()
    straight, timing, graph_breaks = fit(small_corpus, tmp_path / "straight", steps=4, order=0)
    assert straight.global_step == 4
    assert graph_breaks == 0
    losses = _callback(straight, Losses)
    assert len(losses.losses) == 2 * EPOCH_BATCHES
    assert losses.sizes == {MICRO}
    assert losses.accumulation == GLOBAL // MICRO
    assert timing.timed == [1, 2, 4, 8, 16, 4, 8, 4, 8, 4, 8]  # the best two re-timed in turns
    compile_callback = _callback(straight, RegionalCompile)
    assert compile_callback.compiled == [
        "model.vision.blocks.0", "model.vision.blocks.1",
        "model.language_model.blocks.0", "model.language_model.blocks.1",
    ]  # fmt: skip
    assert compile_callback.watch.graphs == 2  # one graph per block class, four blocks
    assert [s.implementation for s in _callback(straight, FusedOptimizer).switched] == ["fused"]
    assert straight.optimizers[0].param_groups[0]["fused"] is True
    swap = _callback(straight, AttentionSwap)
    assert swap.report is not None
    assert len(swap.report.swapped) == 4
    assert not swap.report.reverted
    assert _callback(straight, ActivationCheckpointing).checkpointed
    monitor = _callback(straight, SpeedMonitor)
    assert monitor.summary["flops_per_sample"] > 0
    assert len(_callback(straight, ProfilerSchedule).traces) == 1

    # the same run cut at its epoch end and resumed, each with the callbacks in other orders
    first, _, _ = fit(small_corpus, tmp_path / "cut", steps=2, order=3)
    (ckpt,) = sorted((tmp_path / "cut" / "ckpt").glob("*.ckpt"))
    saved = torch.load(ckpt, weights_only=True)
    state = saved["state_dict"]
    assert "model.vision.blocks.0.attn.qkv.weight" in state  # plain names: no _orig_mod
    assert not any("_orig_mod" in key or "_checkpoint_wrapped" in key for key in state)
    assert saved["optimizer_states"][0]["param_groups"][0]["fused"] is None  # as constructed
    resumed, resumed_timing, resumed_breaks = fit(
        small_corpus, tmp_path / "resumed", steps=4, order=6, ckpt=ckpt
    )
    assert resumed.global_step == 4
    assert resumed_timing.timed == []  # the checkpoint's micro-batch, not timed again
    assert resumed_breaks == 0
    before = _callback(first, Losses).losses
    after = _callback(resumed, Losses).losses
    assert sorted(before) == list(range(EPOCH_BATCHES))
    assert sorted(after) == list(range(EPOCH_BATCHES, 2 * EPOCH_BATCHES))
    for index, loss in {**before, **after}.items():
        assert loss == pytest.approx(losses.losses[index], rel=1e-5), index
    assert _callback(resumed, Losses).sizes == {MICRO}
    assert resumed.optimizers[0].param_groups[0]["fused"] is True  # switched after the load
