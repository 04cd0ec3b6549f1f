"""AccumulationScheduler on two CPU processes (gloo): exact steps, no_sync, adaptive, resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_speedkit import AccumulationScheduler
from tests.helpers.modules import load_module
from tests.helpers.multiprocess import SCRIPTS, run_script

pytestmark = pytest.mark.multiprocess

DIM, MICRO = 16, 8


def script_module() -> Any:
    return load_module(SCRIPTS / "accumulation_ddp.py")


def reference(
    global_batches: list[int], dtype: torch.dtype = torch.float64, lr: float = 0.05
) -> dict[str, Any]:
    """One process, plain SGD: each step on the next ``global_batch`` samples at once."""
    script = script_module()
    model = script.Regression(dtype=dtype)
    x, y = script.dataset(256, dtype).tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    start = 0
    for global_batch in global_batches:
        rows = slice(start, start + global_batch)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model.layer(x[rows]), y[rows]).backward()
        optimizer.step()
        start += global_batch
    return model.state_dict()


def test_target_on_two_ranks_equals_one_large_batch_step(tmp_path: Path) -> None:
    ranks = run_script("accumulation_ddp.py", tmp_path, "--target", "64", "--save-every", "2")
    expected = reference([64, 64])
    for rank, result in enumerate(ranks):
        # 64 = 4 micro-batches of 8 on each of 2 ranks
        assert [(c["accumulation"], c["global_batch"]) for c in result["history"]] == [(4, 64)]
        assert result["micro_batches"] == 8
        assert result["hook_calls"] == 2  # one all-reduce per step: no_sync on the other three
        params = torch.load(tmp_path / f"params{rank}.pt", weights_only=True)
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-12)

    # Resume that run on one process: the target is kept, the accumulation doubles.
    callback = AccumulationScheduler(target_global_batch=64)
    script = script_module()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )  # fmt: skip
    model = script.Regression()
    loader = DataLoader(script.dataset(256), batch_size=MICRO)
    trainer.fit(model, loader, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    assert [(c.step, c.accumulation, c.global_batch) for c in callback.history] == [
        (0, 4, 64),
        (2, 8, 64),
    ]
    assert len(model.losses) == 8


def test_ddp_powersgd_accumulates_with_no_sync(tmp_path: Path) -> None:
    ranks = run_script("accumulation_ddp.py", tmp_path, "--strategy", "ddp_powersgd",
                       "--target", "32", "--steps", "6")  # fmt: skip
    for result in ranks:
        assert [c["accumulation"] for c in result["history"]] == [2]
        assert result["micro_batches"] == 12
        assert result["hook_calls"] == 6  # the PowerSGD hook ran once per step, not per micro-batch
        assert result["last_loss"] < result["first_loss"]


# The adaptive runs read a virtual clock (accumulation_ddp_virtual_time.py): the script's
# delays advance it instead of sleeping, so the measurements are exact and the same on any
# machine. Delays in binary fractions of a second keep every sum exact.
MS = 2.0**-10  # "about a millisecond" of compute per micro-batch


def test_adaptive_raises_accumulation_over_a_slow_all_reduce(tmp_path: Path) -> None:
    slow = 64 * MS  # 62.5 ms of all-reduce against ~1 ms of compute
    ranks = run_script("accumulation_ddp_virtual_time.py", tmp_path, "--mode", "adaptive",
                       "--slow-comm", str(slow), "--step-delay", str(MS), "--max-global-batch",
                       "256", "--steps", "14", "--samples", "2048")  # fmt: skip
    assert ranks[0]["history"] == ranks[1]["history"]  # every rank follows rank 0's decision
    probe, raised = ranks[0]["history"]
    assert (probe["accumulation"], probe["step"]) == (2, 0)
    # share 64 / 66: up to the ceiling, 256 / (8 x 2) = 16, after the probe's 5 steps
    assert (raised["step"], raised["accumulation"], raised["global_batch"]) == (5, 16, 256)
    before, after = ranks[0]["measurements"]
    # the synchronising micro-batch is slower by exactly the all-reduce: no_sync on the others
    assert before == {"accumulation": 2, "step_s": 2 * MS + slow, "micro_batch_s": MS,
                      "comm_s": slow, "optimizer_s": 0.0}  # fmt: skip
    assert before["comm_s"] > 0.04
    assert before["comm_s"] / before["step_s"] > 0.3
    assert after == {"accumulation": 16, "step_s": 16 * MS + slow, "micro_batch_s": MS,
                     "comm_s": slow, "optimizer_s": 0.0}  # fmt: skip
    assert after["comm_s"] / after["step_s"] < before["comm_s"] / before["step_s"]


def test_adaptive_keeps_one_micro_batch_when_compute_dominates(tmp_path: Path) -> None:
    delay = 32 * MS
    ranks = run_script("accumulation_ddp_virtual_time.py", tmp_path, "--mode", "adaptive",
                       "--step-delay", str(delay), "--steps", "10",
                       "--samples", "2048")  # fmt: skip
    assert ranks[0]["history"] == ranks[1]["history"]
    assert [c["accumulation"] for c in ranks[0]["history"]] == [2, 1]  # probe, then back
    (measured,) = ranks[0]["measurements"]
    assert measured == {"accumulation": 2, "step_s": 2 * delay, "micro_batch_s": delay,
                        "comm_s": 0.0, "optimizer_s": 0.0}  # fmt: skip
    assert measured["comm_s"] / measured["step_s"] < 0.3
    assert measured["micro_batch_s"] >= 0.02


@pytest.mark.deepspeed
def test_deepspeed_zero2_follows_a_mid_run_schedule(tmp_path: Path) -> None:
    # DeepSpeed keeps its own window: the callback sets the engine's batch size and
    # boundary, and leaves the loss division to the engine (Lightning would divide twice).
    ranks = run_script("accumulation_ddp.py", tmp_path, "--strategy", "deepspeed",
                       "--schedule", '{"0": 16, "1": 64}', "--steps", "3")  # fmt: skip
    expected = reference([16, 64, 64], dtype=torch.float32)
    for rank, result in enumerate(ranks):
        assert [c["accumulation"] for c in result["history"]] == [1, 4]
        assert result["micro_batches"] == 9
        params = torch.load(tmp_path / f"params{rank}.pt", weights_only=True)
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-6)


def reference_epochs(windows: list[int], samples: int, epochs: int) -> dict[str, Any]:
    """One process, fp32 SGD: per epoch, a step on each window's samples, in order."""
    steps = [w for _ in range(epochs) for w in windows]
    assert sum(windows) == samples
    script = script_module()
    model = script.Regression(dtype=torch.float32)
    x, y = script.dataset(samples, torch.float32).tensors
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    for global_batch in steps:
        rows = slice(start % samples, start % samples + global_batch)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model.layer(x[rows]), y[rows]).backward()
        optimizer.step()
        start += global_batch
    return model.state_dict()


@pytest.mark.parametrize("strategy", [pytest.param("deepspeed", marks=pytest.mark.deepspeed),
                                      "fsdp_zero2"])  # fmt: skip
def test_an_epochs_short_last_window_steps_at_the_epochs_end(tmp_path: Path, strategy: str) -> None:
    """Two epochs of 3 micro-batches a rank at an accumulation of 2: windows of 2 and 1
    micro-batches each epoch, 4 steps. DeepSpeed counted its window across epochs (the
    last micro-batch of epoch 1 and the first of epoch 2 made one step: 3 steps); the
    engine now gets the short window's length, so it steps and divides as Lightning does."""
    ranks = run_script("accumulation_ddp.py", tmp_path, "--strategy", strategy,
                       "--target", "32", "--samples", "48", "--epochs", "2",
                       "--steps", "-1")  # fmt: skip
    for result in ranks:
        assert result["micro_batches"] == 6
        assert result["global_step"] == 4
    params = torch.load(tmp_path / "params0.pt", weights_only=True)
    for name, value in reference_epochs([32, 16], samples=48, epochs=2).items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-6)


@pytest.mark.deepspeed
def test_the_deepspeed_preset_divides_lightnings_accumulated_loss_once(tmp_path: Path) -> None:
    """Lightning divides the loss by ``accumulate_grad_batches`` and DeepSpeed's backward
    divided it again: the gradients came out 4x too small (SGD: lr / 4). The preset's
    backward divides once; the callback, which sets Lightning's divisor to 1 and moves
    the engine's window, leaves the division to the engine (the test above)."""
    run_script("accumulation_ddp.py", tmp_path, "--strategy", "deepspeed", "--mode", "plain",
               "--accumulate", "4", "--steps", "2")  # fmt: skip
    params = torch.load(tmp_path / "params0.pt", weights_only=True)
    for name, value in reference([64, 64], dtype=torch.float32).items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-6)


def test_fsdp_zero2_follows_a_target(tmp_path: Path) -> None:
    # Lightning runs FSDP without no_sync: each micro-batch reduce-scatters, and the
    # sharded gradients still add up to one step over the larger batch.
    ranks = run_script("accumulation_ddp.py", tmp_path, "--strategy", "fsdp_zero2",
                       "--target", "64", "--steps", "2")  # fmt: skip
    for result in ranks:
        assert [c["accumulation"] for c in result["history"]] == [4]
        assert result["micro_batches"] == 8
    params = torch.load(tmp_path / "params0.pt", weights_only=True)  # consolidated on rank 0
    for name, value in reference([64, 64], dtype=torch.float32).items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-6)
