"""FrozenFeatureCache on two CPU ranks (gloo): DDP, DeepSpeed's ZeRO-2, FSDP1's and FSDP2's
ZeRO-2 presets, one shared folder.

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
            assert counts["disk_other_bytes"] == 0  # no shard of other weights or data
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
@pytest.mark.parametrize("strategy", ["fsdp_zero2", "fsdp2_zero2"])
def test_fsdp_ranks_are_served_share_a_folder_and_keep_the_losses(
    tmp_path: Path, strategy: str
) -> None:
    """FSDP1 (``use_orig_params=True``) lends the tower, in forward, views of a flat
    parameter that also holds the trainable head's, and those views require grad; the
    cache asks the tower's own parameters (frozen) and serves it. FSDP2 lends it the
    same gathered parameters every step. The frozen slice's gradient is never applied
    (FSDP gives a frozen parameter no gradient), so the losses stay bit for bit."""
    features = tmp_path / "features"
    ranks = run_script("frozen_cache_ddp.py", tmp_path, "--strategy", strategy,
                       "--features", str(features))  # fmt: skip
    _check_cached_run(ranks)
    for rank in ranks:
        assert [c["plain_calls"] for c in rank["cached"]["counts"]] == [0, 0, 0]
    shards = sorted(features.rglob("*.bin"))
    assert len(shards) == 2  # one per rank, in one folder: the same fingerprint on both
    assert len({p.parent for p in shards}) == 1
    assert sum(p.stat().st_size for p in shards) == 2 * EPOCH * ROW


@pytest.mark.slow
@pytest.mark.multiprocess
def test_under_fsdp_zero2_a_tower_trained_mid_run_runs_then_is_fingerprinted_again(
    tmp_path: Path,
) -> None:
    """Unfrozen for epoch 1 (and trained: the optimizer holds it), the tower runs on every
    call without the store; frozen again, its new weights are misses on both ranks, also
    on the rank whose shard holds none of the tower (its own parameters there did not
    change), and served from the epoch after."""
    features = tmp_path / "features"
    ranks = run_script("frozen_cache_ddp.py", tmp_path, "--strategy", "fsdp_zero2",
                       "--features", str(features), "--retrain", "--epochs", "4")  # fmt: skip
    for rank in ranks:
        plain, cached = rank["plain"], rank["cached"]
        assert len(plain["losses"]) == 16
        assert cached["losses"] == plain["losses"]  # bit for bit
        # epoch 0 runs; epoch 1 runs plain (4 calls); epoch 2 runs the new weights;
        # epoch 3 checks on its first batch and serves the rest
        assert cached["tower_rows"] == [8] * 13
        counts = cached["counts"]
        assert [c["plain_calls"] for c in counts] == [0, 4, 4, 4]
        assert [c["hits"] for c in counts] == [0, 0, 0, EPOCH - 8]
        assert [c["stored"] for c in counts] == [EPOCH, EPOCH, 2 * EPOCH, 2 * EPOCH]
        # the shards it serves from: both ranks', of the trained weights only (the first
        # weights' stay in the folder, counted apart: disk_other_bytes)
        assert counts[-1]["disk_bytes"] == 2 * EPOCH * ROW
        assert counts[-1]["disk_other_bytes"] == 2 * EPOCH * ROW
    folders = {p.parent for p in features.rglob("*.bin")}
    assert len(folders) == 2  # the first weights' and the trained ones'
