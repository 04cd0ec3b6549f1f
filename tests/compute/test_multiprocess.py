"""The compute levers on two CPU processes: DDP and the ZeRO-2 presets train, agree and resume."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import lightning as L
import pytest

from lightning_speedkit import MicroBatchTuner, SpeedkitConfigError

from ..helpers.multiprocess import run_script
from .models import Net


@pytest.mark.slow
@pytest.mark.multiprocess
def test_compute_levers_train_on_two_ranks_and_resume_exactly(tmp_path: Path) -> None:
    # one pair of processes runs every strategy in turn (they start once)
    strategies = "ddp,fsdp_zero2" + (",deepspeed_zero2" if _deepspeed() else "")
    args = ["--strategies", strategies]
    ranks = run_script("compute_ddp.py", tmp_path, *args)
    for strategy in strategies.split(","):
        tuner = not strategy.startswith("deepspeed")  # MicroBatchTuner refuses it (below)
        for rank in (ranks[0][strategy], ranks[1][strategy]):
            assert rank["global_step"] == 4
            assert rank["compiled"] == ["blocks.0", "blocks.1"]
            assert rank["graphs"] == 1  # both blocks share one compiled graph, on every rank
            assert rank["fused"] == ["fused"]
            # the resumed fit trains the same steps 3 and 4 as the straight one
            half = len(rank["losses"]) // 2
            assert rank["resumed_losses"] == pytest.approx(rank["losses"][half:], rel=1e-5)
            if tuner:
                # rank 0 timed 16 fastest, but it is over rank 1's memory; rank 1 timed 4
                # fastest: every rank trains with 8, rank 0's best of what fits on both,
                # two micro-batches per optimizer step (8 x 2 x 2 ranks = the global 32)
                assert rank["sizes"] == [8] * 8
                assert rank["resumed_sizes"] == [8] * 4
                assert rank["tuned"]["best"] == 8  # on rank 1 too: its result says so
                assert list(rank["tuned"]["table"]) == ["1", "2", "4", "8", "16"]  # together
                assert rank["resumed_tuned"] == {"best": 8, "table": {}}  # from the checkpoint
        if tuner:
            skipped = [ranks[r][strategy]["tuned"]["table"]["16"] for r in (0, 1)]
            assert skipped[0] == "does not fit on another rank"
            assert skipped[1].startswith("peak 1073741824.00 GiB over the limit")
        if strategy != "fsdp_zero2":  # FSDP's parameters are sharded: each rank has its part
            assert ranks[0][strategy]["checksum"] == ranks[1][strategy]["checksum"]
    # the same global batch and data: DDP and ZeRO-2 train the same numbers
    assert ranks[0]["fsdp_zero2"]["losses"] == pytest.approx(ranks[0]["ddp"]["losses"], rel=1e-5)


@pytest.mark.deepspeed
def test_micro_batch_tuner_refuses_deepspeed_with_the_way_out() -> None:
    trainer = L.Trainer(strategy="deepspeed_zero2", accelerator="cpu", devices=1, logger=False)
    with pytest.raises(SpeedkitConfigError, match=r"under DeepSpeed.*result.best\['batch_size'\]"):
        MicroBatchTuner().setup(trainer, Net(), "fit")


def _deepspeed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None
