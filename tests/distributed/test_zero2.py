"""ZeRO-2 presets on two CPU processes: they train, shard, resume exactly, and consolidate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

import lightning_speedkit
from lightning_speedkit import DeepSpeedZeRO2Strategy, FSDPZeRO2Strategy, SpeedkitConfigError
from lightning_speedkit._blocks import repeated_block_types
from lightning_speedkit.distributed import zero2_bucket_size
from tests.helpers.modules import load_module
from tests.helpers.multiprocess import SCRIPTS, run_script


def script() -> Any:
    return load_module(SCRIPTS / "zero2_ddp.py")


def consolidated(strategy: str, checkpoint: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The whole model's weights from a checkpoint, as a single-device module loads them."""
    if strategy.startswith("deepspeed"):
        from lightning.pytorch.utilities.deepspeed import (
            convert_zero_checkpoint_to_fp32_state_dict,
        )

        out = tmp_path / f"{checkpoint.name}.consolidated.pt"
        convert_zero_checkpoint_to_fp32_state_dict(checkpoint, out)
        checkpoint = out
    state = torch.load(checkpoint, weights_only=False)["state_dict"]
    return {k: v.float() for k, v in state.items()}


def full_loss(task: Any) -> float:
    x, y = script().dataset().tensors
    with torch.no_grad():
        return float(nn.functional.mse_loss(task.net(x), y))


def test_repeated_blocks_of_the_example_vlm() -> None:
    from speedkit_examples.vlm import VLM, VLMConfig

    model = VLM(VLMConfig.preset("tiny", 64))
    found = [kind.__name__ for kind in repeated_block_types(model)]
    assert found == ["VisionBlock", "DecoderBlock"]
    # layers repeated inside one block (Linear, Linear in an MLP) are not blocks
    assert repeated_block_types(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))) == []


def test_preset_names_are_registered() -> None:
    assert lightning_speedkit.FSDPZeRO2Strategy is FSDPZeRO2Strategy
    for name in ("deepspeed_zero2", "deepspeed_zero2_offload", "fsdp_zero2"):
        assert name in StrategyRegistry


def test_bucket_size_follows_the_model() -> None:
    small = nn.Linear(8, 8)
    assert zero2_bucket_size(small) == 2**20  # the floor: latency-bound messages below
    wide = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(32)])  # 134M parameters
    assert zero2_bucket_size(wide) == pytest.approx(134_283_264 / 8, rel=1e-6)


@pytest.mark.deepspeed
def test_deepspeed_preset_refuses_another_stage() -> None:
    with pytest.raises(SpeedkitConfigError, match="fixed by the ZeRO-2 preset"):
        DeepSpeedZeRO2Strategy(stage=3)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "strategy",
    [
        "fsdp_zero2",
        pytest.param("deepspeed_zero2", marks=pytest.mark.deepspeed),
        pytest.param("deepspeed_zero2_offload", marks=pytest.mark.deepspeed),
    ],
)
def test_preset_trains_shards_resumes_and_consolidates(strategy: str, tmp_path: Path) -> None:
    straight = run_script("zero2_ddp.py", tmp_path / "straight", "--strategy", strategy,
                          "--steps", "8", "--save-every", "4")  # fmt: skip
    for result in straight:
        assert result["global_step"] == 8
        # ZeRO-2: each of two ranks holds about half of Adam's two fp32 moments
        share = result["optimizer_state_bytes"] / result["unsharded_adam_bytes"]
        assert 0.45 < share < 0.55, share
    if strategy == "fsdp_zero2":
        assert straight[0]["blocks"] == ["Block"]  # the wrap policy found the blocks

    ckpt = tmp_path / "straight" / "ckpt"
    resumed = run_script("zero2_ddp.py", tmp_path / "resumed", "--strategy", strategy,
                         "--steps", "8", "--save-every", "4",
                         "--resume", str(ckpt / "epoch=0-step=4.ckpt"))  # fmt: skip
    for rank in range(2):
        assert resumed[rank]["global_step"] == 8
        assert resumed[rank]["losses"] == pytest.approx(straight[rank]["losses"][4:], rel=1e-5)

    # Consolidated weights load into a plain single-device module, which has learned.
    end = consolidated(strategy, ckpt / "epoch=1-step=8.ckpt", tmp_path)
    again = consolidated(strategy, tmp_path / "resumed" / "ckpt" / "epoch=1-step=8.ckpt", tmp_path)
    for name, value in end.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=1e-6)
    task = script().Task()
    before = full_loss(task)
    task.load_state_dict(end, strict=True)
    assert full_loss(task) < 0.7 * before


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "strategy", ["fsdp_zero2", pytest.param("deepspeed_zero2", marks=pytest.mark.deepspeed)]
)
def test_activation_checkpointing_under_the_presets_changes_no_number(
    strategy: str, tmp_path: Path
) -> None:
    plain = run_script("zero2_ddp.py", tmp_path / "plain", "--strategy", strategy, "--steps", "3")
    ckpt = run_script("zero2_ddp.py", tmp_path / "ckpt", "--strategy", strategy, "--steps", "3",
                      "--checkpointing")  # fmt: skip
    for rank in range(2):
        assert ckpt[rank]["checkpointed"] == [f"net.blocks.{i}" for i in range(4)]
        assert ckpt[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-6)
