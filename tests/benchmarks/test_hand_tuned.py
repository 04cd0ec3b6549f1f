"""The hand-tuned baseline must be the same model and optimizer, only tuned by hand."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from speedkit_examples.vlm.model import VLM, VLMConfig
from speedkit_examples.vlm.task import VLMTask
from speedkit_examples.vlm.tokenizer import CaptionTokenizer
from tests.helpers.modules import load_module

from ..conftest import SMALL_CORPUS

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hand_tuned.py"


def test_sdpa_written_into_the_model_computes_the_models_own_attention() -> None:
    module = load_module(SCRIPT)
    torch.manual_seed(0)
    cfg = VLMConfig.preset("tiny", vocab_size=64)
    model = VLM(cfg)
    hand = copy.deepcopy(model)
    assert module.write_sdpa_into(hand) == cfg.vision_depth + cfg.text_depth
    images = torch.randn(3, 3, cfg.image_size, cfg.image_size)
    ids = torch.randint(0, 64, (3, 11))
    outputs = [m(images, ids) for m in (model, hand)]
    assert torch.allclose(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    for out in outputs:
        out.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), hand.parameters(), strict=True):
        assert p.grad is not None, name
        assert q.grad is not None, name
        assert torch.allclose(q.grad, p.grad, rtol=1e-4, atol=1e-6), name
    # The causal mask really is applied: a later token does not change an earlier output.
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64
    with torch.no_grad():
        a, b = hand(images, ids), hand(images, changed)
    assert torch.equal(a[:, :-1], b[:, :-1])
    assert not torch.equal(a[:, -1], b[:, -1])


def test_the_hand_tuned_optimizer_is_the_tasks_adamw_fused() -> None:
    module = load_module(SCRIPT)
    cfg = VLMConfig.preset("tiny", vocab_size=CaptionTokenizer().vocab_size)
    torch.manual_seed(0)
    plain_config = VLMTask(cfg).configure_optimizers()
    plain = plain_config["optimizer"]
    torch.manual_seed(0)
    task = module.HandTunedTask(cfg, pad_id=0, compile_model=False)
    hand_config = task.configure_optimizers()
    hand = hand_config["optimizer"]
    assert isinstance(hand, torch.optim.AdamW)
    assert hand.defaults["fused"] is True
    assert len(hand.param_groups) == len(plain.param_groups) == 2
    for ours, theirs in zip(hand.param_groups, plain.param_groups, strict=True):
        assert [p.shape for p in ours["params"]] == [p.shape for p in theirs["params"]]
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert ours[key] == theirs[key], key
    # the task's warm-up, driving the fused optimizer
    schedules = [c["lr_scheduler"]["scheduler"] for c in (hand_config, plain_config)]
    assert schedules[0].optimizer is hand
    assert hand_config["lr_scheduler"]["interval"] == "step"
    for _ in range(3):
        for schedule in schedules:
            schedule.step()
        assert schedules[0].get_last_lr() == schedules[1].get_last_lr()


def test_the_compiled_hand_tuned_model_keeps_the_tasks_checkpoint_keys() -> None:
    module = load_module(SCRIPT)
    cfg = VLMConfig.preset("tiny", vocab_size=64)
    task = module.HandTunedTask(cfg, pad_id=0, compile_model=True)
    task.configure_model()
    assert isinstance(task._forward, torch._dynamo.eval_frame.OptimizedModule)
    assert task._forward._orig_mod is task.model
    assert list(task.state_dict()) == list(VLMTask(cfg).state_dict())
    task.configure_model()  # Lightning may call it again: compiled once
    assert task._forward._orig_mod is task.model
    # The task's forward goes through the compiled model (spied on, run eagerly here).
    calls = []

    def spy(images: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        calls.append(ids.shape)
        return task.model(images, ids)  # type: ignore[no-any-return]

    object.__setattr__(task, "_forward", spy)
    images = torch.randn(2, 3, cfg.image_size, cfg.image_size)
    logits = task(images, torch.randint(0, 64, (2, 5)))
    assert calls == [torch.Size([2, 5])]
    assert logits.shape[-1] == 64


def test_the_hand_tuned_loader_serves_the_preloaded_samples(
    small_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_module(SCRIPT)
    config = VLMConfig.preset("tiny", CaptionTokenizer().vocab_size)
    data = module.HandTunedData.for_model(
        config, str(small_corpus), batch_size=8, corpus=SMALL_CORPUS, progress=False,
        micro_batch=4, preload=True, pin_memory=False,
    )  # fmt: skip
    data.setup("fit")
    train = data.datasets["train"]
    loader = data.train_dataloader()
    assert loader.dataset is data.preloaded
    assert len(data.preloaded) == len(train)

    def decoded(*args: Any) -> Any:
        raise AssertionError("the training split was decoded again")

    monkeypatch.setattr(type(train), "__getitem__", decoded)
    batch = next(iter(loader))  # from memory only
    first = [data.preloaded[i] for i in list(loader.sampler)[:4]]
    assert torch.equal(batch["images"], torch.stack([s["images"] for s in first]))


@pytest.mark.slow
def test_the_benchmark_runs_plain_and_hand_tuned_side_by_side(
    demo_corpus: Path, tmp_path: Path
) -> None:
    module = load_module(SCRIPT)
    out = tmp_path / "hand.json"
    argv = ["--steps", "6", "--warmup-steps", "2", "--runs", "plain,hand", "--rounds", "2",
            "--micro-batch", "16", "--data-dir", str(demo_corpus),
            "--output-dir", str(tmp_path / "runs"), "--out", str(out)]  # fmt: skip
    assert module.main(argv) == 0
    saved = json.loads(out.read_text())
    assert saved["complete"] is True
    assert saved["config"]["micro_batch"] == 16
    assert saved["config"]["compile"] is False
    assert len(saved["rounds"]) == 2
    for round_ in saved["rounds"]:
        plain, hand = round_["plain"], round_["hand"]
        assert plain["steps"] == hand["steps"] == 6
        # Same seed, data order and optimizer batch (2 micro-batches of 16): the first
        # steps' loss agrees to float32 rounding (SDPA and the accumulation reorder sums).
        assert hand["loss_start"] == pytest.approx(plain["loss_start"], rel=1e-4)
        assert "micro-batch 16 x 2" in hand["notes"][0]
        assert "4,096 samples decoded into memory" in hand["notes"][0]
    ratios = saved["ratios"]["hand/plain"]
    expected = [
        r["hand"]["samples_per_sec"] / r["plain"]["samples_per_sec"] for r in saved["rounds"]
    ]
    assert ratios["rounds"] == pytest.approx(expected)
    assert set(saved["ratios"]) == {"hand/plain"}  # no kit run, no kit ratio


def test_each_run_reaches_the_file_as_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_module(SCRIPT)
    finished = []

    def train(config: Any, run: str, peak: Any) -> Any:
        if len(finished) == 3:  # round 2's kit run: a crash, or a machine's time limit
            raise RuntimeError("killed")
        finished.append(run)
        speed = {"plain": 100.0, "kit": 150.0}[run]
        return module.DemoResult(run, [], "tiny", 1, 1, 6, speed, None, None, None, None,
                                 None, None, 1.0, 0.5, 0.5, 0.5, 10.0 * len(finished))  # fmt: skip

    monkeypatch.setattr(module, "_train", train)
    monkeypatch.setattr(module, "shared_peak", lambda *a, **k: 1e9)
    out = tmp_path / "hand.json"
    argv = ["--runs", "plain,kit", "--rounds", "2", "--steps", "6", "--warmup-steps", "2",
            "--output-dir", str(tmp_path / "runs"), "--out", str(out)]  # fmt: skip
    with pytest.raises(RuntimeError, match="killed"):
        module.main(argv)
    saved = json.loads(out.read_text())
    assert saved["complete"] is False
    assert [list(r) for r in saved["rounds"]] == [["plain", "kit"], ["plain"]]
    assert saved["ratios"] == {"kit/plain": {"rounds": [1.5], "median": 1.5}}
    assert saved["wall_sec_median"] == {"plain": 20.0, "kit": 20.0}  # medians of 10, 30; 20
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == ["hand.json"]


def test_a_micro_batch_that_does_not_divide_the_batch_is_refused(tmp_path: Path) -> None:
    module = load_module(SCRIPT)
    config = module.DemoConfig(batch_size=32, output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="does not divide --batch-size 32"):
        module.train_hand_tuned(
            config, 1e9, micro_batch=5, num_workers=0, preload=False, compile_model=False
        )
