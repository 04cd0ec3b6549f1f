"""FrozenFeatureCache on two CPU ranks (gloo): DDP and DeepSpeed's ZeRO-2, one shared folder.

Each rank caches what its DistributedSampler gives it and writes its own shards; at each
epoch's end every rank reads the others', so a sample first seen on rank 0 is served on
rank 1 in a later epoch. The losses are the plain run's, bit for bit (the script's tower
gives a row the same bits in any batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ..helpers.multiprocess import run_script

ROW = 16 * 4  # a sample's features: 16 float32
EPOCH = 32  # samples per rank per epoch (64 over two ranks)


def _check_cached_run(ranks: list[dict[str, Any]]) -> None:
    for rank, other in ((ranks[0], ranks[1]), (ranks[1], ranks[0])):
        plain, cached = rank["plain"], rank["cached"]
        assert len(plain["losses"]) == 12  # 3 epochs of 4 steps
        assert cached["losses"] == plain["losses"]  # bit for bit
        # epoch 1 runs its 4 batches; epoch 2 runs its first to check the stored
        # features; every other batch is served whole
        assert plain["tower_rows"] == [8] * 12
        assert cached["tower_rows"] == [8] * 5
        hits = [c["hits"] for c in cached["counts"]]
        assert hits == [0, EPOCH - 8, 2 * EPOCH - 8]
        assert [c["stored"] for c in cached["counts"]] == [EPOCH] * 3
        for counts in cached["counts"]:  # this rank's 32 in memory; both ranks' 64 on disk
            assert counts["store_bytes"] == EPOCH * ROW
            assert counts["disk_bytes"] == 2 * EPOCH * ROW
        # epoch 3 was served whole, and it held samples only the other rank had run
        first, last = cached["samples"][0], cached["samples"][2]
        from_other = set(last) - set(first)
        assert from_other
        assert from_other <= set(other["cached"]["samples"][0])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ddp_ranks_share_a_folder_keep_the_losses_and_a_new_job_starts_warm(
    tmp_path: Path,
) -> None:
    features = tmp_path / "features"
    ranks = run_script("frozen_cache_ddp.py", tmp_path / "first", "--strategy", "ddp",
                       "--features", str(features))  # fmt: skip
    _check_cached_run(ranks)
    shards = sorted(features.rglob("*.bin"))
    assert len(shards) == 2  # one per rank
    assert sum(p.stat().st_size for p in shards) == 2 * EPOCH * ROW
    # new processes, the same folder, no memory for features (budget 0): warm from disk
    warm = run_script("frozen_cache_ddp.py", tmp_path / "warm", "--strategy", "ddp",
                      "--features", str(features), "--runs", "cached", "--budget", "0",
                      "--epochs", "2")  # fmt: skip
    for rank, before in zip(warm, ranks, strict=True):
        cached = rank["cached"]
        assert cached["losses"] == before["plain"]["losses"][:8]
        assert cached["tower_rows"] == [8]  # the first batch checks what was read back
        assert [c["hits"] for c in cached["counts"]] == [EPOCH - 8, 2 * EPOCH - 8]
        assert cached["counts"][-1]["stored"] == 0
        assert cached["counts"][-1]["store_bytes"] == 0
        assert cached["counts"][-1]["disk_bytes"] == 2 * EPOCH * ROW
    assert sorted(features.rglob("*.bin")) == shards  # nothing written again


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.deepspeed
def test_deepspeed_zero2_ranks_share_a_folder_and_keep_the_losses(tmp_path: Path) -> None:
    ranks = run_script("frozen_cache_ddp.py", tmp_path, "--strategy", "deepspeed_zero2",
                       "--features", str(tmp_path / "features"))  # fmt: skip
    _check_cached_run(ranks)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_under_fsdp_zero2_the_tower_runs_as_it_is_and_the_losses_stay(tmp_path: Path) -> None:
    """FSDP1 (``use_orig_params=True``) gives the tower, in forward, views of a flat
    parameter that also holds the trainable head's: they require grad, so the cache runs
    the tower without the store (it would cut a gradient) and says so."""
    ranks = run_script("frozen_cache_ddp.py", tmp_path, "--strategy", "fsdp_zero2",
                       "--features", str(tmp_path / "features"))  # fmt: skip
    for rank in ranks:
        assert rank["cached"]["losses"] == rank["plain"]["losses"]
        assert rank["cached"]["tower_rows"] == [8] * 12
        last = rank["cached"]["counts"][-1]
        assert (last["hits"], last["stored"], last["plain_calls"]) == (0, 0, 12)
    assert not list((tmp_path / "features").rglob("*.bin"))
