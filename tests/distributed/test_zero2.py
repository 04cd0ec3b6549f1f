"""ZeRO-2 presets on two CPU processes: they train, shard, resume exactly, and consolidate."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import lightning_speedkit
from lightning_speedkit import (
    DeepSpeedZeRO2Strategy,
    FSDP2ZeRO2Strategy,
    FSDPZeRO2Strategy,
    SpeedkitConfigError,
)
from lightning_speedkit._blocks import repeated_block_types
from lightning_speedkit.distributed import apply_fsdp2_zero2, zero2_bucket_size
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


Run = list[dict[str, Any]]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Run, Path]]:
    """A preset's unbroken 8-step run, checkpointed every 4 steps (an epoch): its ranks'
    results and its directory. Each preset runs once, for every test here that judges it
    (training, resuming, checkpointing, moving from FSDP1 to FSDP2): a two-process run
    spends most of its 10-15 s starting Python twice."""
    runs: dict[str, tuple[Run, Path]] = {}

    def run(strategy: str) -> tuple[Run, Path]:
        if strategy not in runs:
            out = tmp_path_factory.mktemp(f"straight-{strategy}")
            # DeepSpeed's and FSDP2's unbroken runs start as a user's job does (`python
            # script.py`, Lightning's launcher starting rank 1); the rest, warm
            ranks = run_script("zero2_ddp.py", out, "--strategy", strategy, "--steps", "8",
                               "--save-every", "4",
                               fresh=strategy in ("deepspeed_zero2", "fsdp2_zero2"))  # fmt: skip
            runs[strategy] = (ranks, out)
        return runs[strategy]

    return run


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
    assert lightning_speedkit.FSDP2ZeRO2Strategy is FSDP2ZeRO2Strategy
    for name in ("deepspeed_zero2", "deepspeed_zero2_offload", "fsdp_zero2", "fsdp2_zero2"):
        assert name in StrategyRegistry
    assert StrategyRegistry["fsdp2_zero2"]["strategy"] is FSDP2ZeRO2Strategy


def test_bucket_size_follows_the_model() -> None:
    small = nn.Linear(8, 8)
    assert zero2_bucket_size(small) == 2**20  # the floor: latency-bound messages below
    wide = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(32)])  # 134M parameters
    assert zero2_bucket_size(wide) == pytest.approx(134_283_264 / 8, rel=1e-6)


@pytest.mark.deepspeed
def test_deepspeed_preset_refuses_another_stage() -> None:
    with pytest.raises(SpeedkitConfigError, match="fixed by the ZeRO-2 preset"):
        DeepSpeedZeRO2Strategy(stage=3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reshard_after_forward": True}, "`reshard_after_forward` is fixed by the ZeRO-2 preset"),
        ({"tensor_parallel_size": 2}, "`tensor_parallel_size` is fixed by the ZeRO-2 preset"),
        ({"sharding_strategy": "FULL_SHARD"}, "`sharding_strategy` is not an argument of FSDP2"),
        ({"blocks": "Block"}, '`blocks` must be "auto" or a non-empty list'),
        ({"blocks": [nn.Linear, "Block"]}, "`blocks` holds an entry that is not an nn.Module"),
    ],
)
def test_fsdp2_preset_refuses_what_it_cannot_do(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(SpeedkitConfigError, match=match):
        FSDP2ZeRO2Strategy(**kwargs)
    # LightningCLI passes ModelParallelStrategy's defaults: those are the preset's own
    FSDP2ZeRO2Strategy(data_parallel_size="auto", tensor_parallel_size="auto")


def test_fsdp2_preset_refuses_a_precision_at_trainer_construction() -> None:
    with pytest.raises(SpeedkitConfigError, match="`precision` is not supported by fsdp2_zero2"):
        L.Trainer(strategy="fsdp2_zero2", accelerator="cpu", devices=2, precision="64-true",
                  logger=False)  # fmt: skip


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(8, 8), nn.GELU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(x)


def _block_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), _Block(), _Block(), nn.Linear(8, 1))


@pytest.fixture
def one_rank() -> Any:
    """A gloo process group of one rank in this process (an in-memory store, no port)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    # The test's FSDP model held the group in reference cycles: finalize it here, where its
    # threads are, not in a loader worker forked later that collects it and hangs.
    gc.collect()


@pytest.mark.usefixtures("one_rank")
def test_apply_fsdp2_zero2_shards_each_block_and_keeps_it_whole_until_backward() -> None:
    model = _block_model()
    assert apply_fsdp2_zero2(model) == ["1", "2"]
    assert isinstance(model, FSDPModule)
    assert isinstance(model[1], FSDPModule)
    assert not isinstance(model[0], FSDPModule)  # a single layer: in the root's unit
    assert isinstance(model[1].ff[0].weight, DTensor)  # sharded between steps
    out = model(torch.randn(4, 8))
    # ZeRO-2: after forward the blocks' parameters stay gathered for backward
    assert not isinstance(model[1].ff[0].weight, DTensor)
    out.sum().backward()
    assert isinstance(model[1].ff[0].weight, DTensor)  # resharded once backward is done
    assert isinstance(model[1].ff[0].weight.grad, DTensor)  # the gradient sharded too

    # fully_shard's own default (reshard after forward) gathers again in backward
    default = _block_model()
    for block in (default[1], default[2], default):
        fully_shard(block)
    default(torch.randn(4, 8))
    assert isinstance(default[1].ff[0].weight, DTensor)


@pytest.mark.usefixtures("one_rank")
def test_apply_fsdp2_zero2_leaves_a_model_that_shards_itself() -> None:
    model = _block_model()
    fully_shard(model[1])
    assert apply_fsdp2_zero2(model) == []
    assert not isinstance(model, FSDPModule)
    assert not isinstance(model[2], FSDPModule)
    chosen = _block_model()
    assert apply_fsdp2_zero2(chosen, blocks=[nn.Sequential]) == ["1.ff", "2.ff"]  # not the root


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "strategy",
    [
        "fsdp_zero2",
        "fsdp2_zero2",
        pytest.param("deepspeed_zero2", marks=pytest.mark.deepspeed),
        pytest.param("deepspeed_zero2_offload", marks=pytest.mark.deepspeed),
    ],
)
def test_preset_trains_shards_resumes_and_consolidates(
    strategy: str, tmp_path: Path, straight: Callable[[str], tuple[Run, Path]]
) -> None:
    whole, whole_dir = straight(strategy)
    for result in whole:
        assert result["global_step"] == 8
        # ZeRO-2: each of two ranks holds about half of Adam's two fp32 moments
        share = result["optimizer_state_bytes"] / result["unsharded_adam_bytes"]
        assert 0.45 < share < 0.55, share
    if strategy in ("fsdp_zero2", "fsdp2_zero2"):
        assert whole[0]["blocks"] == ["Block"]  # the wrap policy found the blocks

    ckpt = whole_dir / "ckpt"
    resumed = run_script("zero2_ddp.py", tmp_path / "resumed", "--strategy", strategy,
                         "--steps", "8", "--save-every", "4",
                         "--resume", str(ckpt / "epoch=0-step=4.ckpt"))  # fmt: skip
    for rank in range(2):
        assert resumed[rank]["global_step"] == 8
        assert resumed[rank]["losses"] == pytest.approx(whole[rank]["losses"][4:], rel=1e-5)

    # Consolidated weights load into a plain single-device module, which has learned.
    if strategy.startswith("fsdp"):
        assert (ckpt / "epoch=1-step=8.ckpt").is_file()  # one file, not a folder of shards
    end = consolidated(strategy, ckpt / "epoch=1-step=8.ckpt", tmp_path)
    again = consolidated(strategy, tmp_path / "resumed" / "ckpt" / "epoch=1-step=8.ckpt", tmp_path)
    for name, value in end.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=1e-6)
    task = script().Task()
    before = full_loss(task)
    task.load_state_dict(end, strict=True)
    assert full_loss(task) < 0.7 * before


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.deepspeed
def test_deepspeed_preset_accumulates_to_the_step_ddp_takes(tmp_path: Path) -> None:
    """Lightning divides the loss by the accumulation and DeepSpeed's backward divided it
    again: with two micro-batches per step, every SGD step was half DDP's."""
    moved = {}
    for strategy in ("ddp", "deepspeed_zero2"):
        runs = run_script("zero2_ddp.py", tmp_path / strategy, "--strategy", strategy,
                          "--steps", "1", "--accumulate", "2", "--sgd")  # fmt: skip
        moved[strategy] = torch.tensor(runs[0]["moved"])
    assert moved["ddp"].abs().max() > 1e-3  # it moved
    torch.testing.assert_close(moved["deepspeed_zero2"], moved["ddp"], rtol=1e-4, atol=1e-7)


class _Stepper(nn.Module):
    """A model run through a method, as Lightning runs ``training_step``, not ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        # a root parameter read before any forward, then forward nested inside the step
        return 0.1 * self.head.weight.sum() + self(x).pow(2).mean()


@pytest.mark.usefixtures("one_rank")
def test_apply_fsdp2_zero2_runs_the_root_hooks_around_a_step_method() -> None:
    plain, sharded = _Stepper(), _Stepper()
    assert apply_fsdp2_zero2(sharded, forward_methods=["step"]) == ["blocks.0", "blocks.1"]
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    sharded_opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    for seed in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        losses = []
        for model, optimizer in ((plain, plain_opt), (sharded, sharded_opt)):
            loss = model.step(x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)


@pytest.mark.multiprocess
def test_fsdp2_preset_resumes_an_fsdp_zero2_checkpoint_exactly(
    tmp_path: Path, straight: Callable[[str], tuple[Run, Path]]
) -> None:
    """Moving a run from FSDP1 to FSDP2: the consolidated checkpoint carries over as it is."""
    fsdp1, fsdp1_dir = straight("fsdp_zero2")
    fsdp2 = run_script("zero2_ddp.py", tmp_path / "fsdp2", "--strategy", "fsdp2_zero2",
                       "--steps", "8", "--resume",
                       str(fsdp1_dir / "ckpt" / "epoch=0-step=4.ckpt"))  # fmt: skip
    for rank in range(2):
        assert fsdp2[rank]["strategy"] == "FSDP2ZeRO2Strategy"
        # weights and AdamW's moments restored: the same losses as FSDP1's own run
        assert fsdp2[rank]["losses"] == pytest.approx(fsdp1[rank]["losses"][4:], rel=1e-5)


@pytest.mark.gpu
def test_fsdp2_preset_on_cuda_trains_resumes_and_consolidates(tmp_path: Path) -> None:
    """fsdp2_zero2 on NCCL in bf16-mixed, on one or two GPUs (an epoch per checkpoint)."""
    n = min(2, torch.cuda.device_count())
    per_epoch = 64 // (8 * n)  # the script's samples and micro-batch
    options = ["--strategy", "fsdp2_zero2", "--accelerator", "cuda", "--devices", str(n),
               "--precision", "bf16-mixed", "--steps", str(2 * per_epoch),
               "--save-every", str(per_epoch)]  # fmt: skip
    straight = run_script("zero2_ddp.py", tmp_path / "straight", *options, world_size=n)
    for result in straight:
        assert result["blocks"] == ["Block"]
        share = result["optimizer_state_bytes"] / result["unsharded_adam_bytes"]
        assert 0.9 / n < share < 1.1 / n, share  # fp32 moments, 1/n of them per rank
    ckpt = tmp_path / "straight" / "ckpt"
    resumed = run_script("zero2_ddp.py", tmp_path / "resumed", *options, "--resume",
                         str(ckpt / f"epoch=0-step={per_epoch}.ckpt"), world_size=n)  # fmt: skip
    for rank in range(n):
        # the same kernels on the same data: equal up to bf16 reduction order, if any
        assert resumed[rank]["losses"] == pytest.approx(
            straight[rank]["losses"][per_epoch:], rel=1e-4
        )
    end = consolidated("fsdp2_zero2", ckpt / f"epoch=1-step={2 * per_epoch}.ckpt", tmp_path)
    task = script().Task()
    before = full_loss(task)
    task.load_state_dict(end, strict=True)
    assert full_loss(task) < 0.7 * before


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "strategy",
    ["fsdp_zero2", "fsdp2_zero2", pytest.param("deepspeed_zero2", marks=pytest.mark.deepspeed)],
)
def test_activation_checkpointing_under_the_presets_changes_no_number(
    strategy: str, tmp_path: Path, straight: Callable[[str], tuple[Run, Path]]
) -> None:
    plain, _ = straight(strategy)  # its first 3 steps: the checkpoint at step 4 comes later
    ckpt = run_script("zero2_ddp.py", tmp_path / "ckpt", "--strategy", strategy, "--steps", "3",
                      "--checkpointing")  # fmt: skip
    for rank in range(2):
        assert ckpt[rank]["checkpointed"] == [f"net.blocks.{i}" for i in range(4)]
        assert ckpt[rank]["losses"] == pytest.approx(plain[rank]["losses"][:3], rel=1e-6)
