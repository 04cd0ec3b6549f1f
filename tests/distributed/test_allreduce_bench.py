from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_speedkit import SpeedkitConfigError
from lightning_speedkit.cli import main
from lightning_speedkit.distributed.allreduce_bench import bench_allreduce, parse_size


def test_sizes_are_read_in_binary_units() -> None:
    assert [parse_size(s) for s in ("4KB", "1MB", "2gb", "512")] == [4096, 2**20, 2 * 2**30, 512]
    with pytest.raises(SpeedkitConfigError, match="Cannot read the size"):
        parse_size("lots")


@pytest.mark.multiprocess
def test_gloo_allreduce_table_follows_nccl_tests_definitions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = bench_allreduce("gloo", 2, sizes=[4096, 2**20], iters=3, warmup=1)
    assert [r.bytes for r in rows] == [4096, 2**20]
    for r in rows:
        assert r.time_us > 0
        assert r.algbw_gbps == pytest.approx(r.bytes / (r.time_us * 1e-6) / 1e9)
        assert r.busbw_gbps == pytest.approx(r.algbw_gbps * 2 * (2 - 1) / 2)
    assert rows[1].algbw_gbps > rows[0].algbw_gbps  # large messages amortise latency

    out = tmp_path / "rows.json"
    code = main(
        ["bench-allreduce", "--sizes", "64KB", "--iters", "2", "--warmup", "0", "--json", str(out)]
    )
    assert code == 0
    assert "busbw (GB/s)" in capsys.readouterr().out
    assert json.loads(out.read_text())[0]["bytes"] == 65536


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"backend": "mpi"}, "backend"), ({"world_size": 1}, "world_size"), ({"iters": 0}, "iters")],
)
def test_bad_arguments_are_refused(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(SpeedkitConfigError, match=f"`{argument}`"):
        bench_allreduce(**kwargs)  # type: ignore[arg-type]


def test_nccl_without_gpus_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs are here: NCCL would run")
    assert main(["bench-allreduce", "--backend", "nccl"]) == 2
    assert "needs one GPU per process" in capsys.readouterr().err
