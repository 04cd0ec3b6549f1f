from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from lightning_speedkit import DDPHalfPrecisionStrategy, DDPPowerSGDStrategy, SpeedkitConfigError
from lightning_speedkit.distributed.powersgd import _ParameterBook

from ..helpers.multiprocess import run_script


def test_strategy_names_are_registered_on_import() -> None:
    for name in ("ddp_powersgd", "ddp_fp16_compress", "ddp_bf16_compress"):
        assert name in StrategyRegistry
    trainer = L.Trainer(strategy="ddp_powersgd", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, DDPPowerSGDStrategy)
    assert (trainer.strategy.rank, trainer.strategy.start_iter) == (1, 100)
    bf16 = L.Trainer(strategy="ddp_bf16_compress", accelerator="cpu", devices=2, logger=False)
    assert isinstance(bf16.strategy, DDPHalfPrecisionStrategy)
    assert bf16.strategy.compress_dtype == "bf16"


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"rank": 0}, "rank"),
        ({"start_iter": 1}, "start_iter"),
        ({"start_iter": -3}, "start_iter"),
        ({"compress_dtype": "int8"}, "compress_dtype"),
        ({"min_compression_rate": 0.5}, "min_compression_rate"),
        ({"ddp_comm_hook": print}, "ddp_comm_hook"),
    ],
)
def test_bad_arguments_name_the_argument_and_the_fix(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(SpeedkitConfigError, match=f"`{argument}`"):
        DDPPowerSGDStrategy(**kwargs)


def test_start_iter_one_is_allowed_without_error_feedback_or_warm_start() -> None:
    DDPPowerSGDStrategy(start_iter=1, error_feedback=False, warm_start=False)


class _Bucket:
    """Stands in for dist.GradBucket: an index, its parameters, a flat buffer."""

    def __init__(self, index: int, params: list[torch.nn.Parameter]) -> None:
        self._index, self._params = index, params
        self._buffer = torch.zeros(sum(p.numel() for p in params))

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def buffer(self) -> torch.Tensor:
        return self._buffer


def test_state_follows_parameters_when_ddp_relays_its_buckets() -> None:
    """DDP's first buckets are in reverse order, later ones in gradient-ready order:
    the state of each parameter must move with it, not stay with the bucket index."""
    a, b, c = (torch.nn.Parameter(torch.zeros(8, 6)) for _ in range(3))
    bias = torch.nn.Parameter(torch.zeros(8))
    names = {id(a): "a", id(b): "b", id(c): "c", id(bias): "bias"}
    state = PowerSGDState(
        None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=2
    )
    book = _ParameterBook(state, names)

    book.on_bucket(_Bucket(0, [a, bias]))  # first layout: {a, bias} and {b, c}
    book.on_bucket(_Bucket(1, [b, c]))
    state.error_dict[0] = torch.cat([torch.full((48,), 1.0), torch.full((8,), 4.0)])
    state.error_dict[1] = torch.cat([torch.full((48,), 2.0), torch.full((48,), 3.0)])
    state.p_memory_dict[0], state.q_memory_dict[0] = torch.full((8,), 1.0), torch.full((6,), 1.0)
    state.p_memory_dict[1] = torch.cat([torch.full((8,), 2.0), torch.full((8,), 3.0)])
    state.q_memory_dict[1] = torch.cat([torch.full((6,), 2.0), torch.full((6,), 3.0)])

    book.on_bucket(_Bucket(0, [c, a]))  # re-laid: {c, a} and {bias, b}
    book.on_bucket(_Bucket(1, [bias, b]))
    assert state.error_dict[0].tolist() == [3.0] * 48 + [1.0] * 48
    assert state.error_dict[1].tolist() == [4.0] * 8 + [2.0] * 48
    assert state.p_memory_dict[0].tolist() == [3.0] * 8 + [1.0] * 8
    assert state.q_memory_dict[1].tolist() == [2.0] * 6  # the bias is not compressed

    exported = book.export()
    assert exported["params"]["bias"]["error"].tolist() == [4.0] * 8
    assert set(exported["params"]["a"]) == {"error", "p", "q"}


def test_a_bucket_that_did_not_move_keeps_its_state() -> None:
    a, b, c = (torch.nn.Parameter(torch.zeros(8, 6)) for _ in range(3))
    names = {id(a): "a", id(b): "b", id(c): "c"}
    state = PowerSGDState(
        None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=2
    )
    book = _ParameterBook(state, names)
    for index, params in enumerate(([a], [b], [c])):
        book.on_bucket(_Bucket(index, params))
        state.error_dict[index] = torch.full((48,), float(index))
    book.on_bucket(_Bucket(0, [b]))  # buckets 0 and 1 swap; bucket 2 stays as it was
    book.on_bucket(_Bucket(1, [a]))
    book.on_bucket(_Bucket(2, [c]))
    assert [state.error_dict[i][0].item() for i in range(3)] == [1.0, 0.0, 2.0]


def _params(out: Path, rank: int) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = torch.load(out / f"params{rank}.pt", weights_only=True)
    return loaded


def _max_diff(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> float:
    return max(float((x[k] - y[k]).abs().max()) for k in x)


@pytest.mark.multiprocess
@pytest.mark.parametrize("buckets", ["one", "per-parameter"])
def test_compresses_on_gloo_and_resumes_exactly(tmp_path: Path, buckets: str) -> None:
    """With one bucket, and with a bucket per parameter (which DDP re-lays after its
    first iteration, and whose collectives gloo must keep in order)."""
    cap = ["--bucket-cap-mb", "25" if buckets == "one" else "0.01"]
    whole = run_script(
        "powersgd_ddp.py", tmp_path / "whole", "--steps", "12", "--save-every", "6", *cap
    )
    for rank in whole:
        if buckets == "one":
            assert rank["hook_calls"] == 12  # registered on CPU: one bucket, every step
        assert rank["powersgd_iter"] == 12
        assert rank["ratio"] == 32.0  # 64x64 matrices at rank 1: 4096 / (64 + 64)
    checkpoint = tmp_path / "whole" / "ckpt" / "epoch=0-step=6.ckpt"
    saved = torch.load(checkpoint, weights_only=True)["callbacks"]["DDPPowerSGDStrategy"]
    assert saved["world_size"] == 2
    assert set(saved["ranks"][1]["params"]["net.0.weight"]) == {"error", "p", "q"}

    resumed = run_script("powersgd_ddp.py", tmp_path / "resumed", "--steps", "12", "--resume",
                         str(checkpoint), *cap)  # fmt: skip
    if buckets == "one":
        assert [r["hook_calls"] for r in resumed] == [6, 6]
    for rank in (0, 1):
        assert (
            _max_diff(_params(tmp_path / "whole", rank), _params(tmp_path / "resumed", rank)) == 0.0
        )

    # The same resume without the saved PowerSGD state does not end where the whole run did.
    stripped = torch.load(checkpoint, weights_only=True)
    del stripped["callbacks"]["DDPPowerSGDStrategy"]
    torch.save(stripped, tmp_path / "stripped.ckpt")
    run_script("powersgd_ddp.py", tmp_path / "fresh", "--steps", "12", "--resume",
               str(tmp_path / "stripped.ckpt"), *cap)  # fmt: skip
    assert _max_diff(_params(tmp_path / "whole", 0), _params(tmp_path / "fresh", 0)) > 1e-4


@pytest.mark.multiprocess
def test_hook_runs_only_on_sync_steps_with_accumulation(tmp_path: Path) -> None:
    ranks = run_script("powersgd_ddp.py", tmp_path, "--steps", "4", "--accumulate", "3")
    assert [r["global_step"] for r in ranks] == [4, 4]
    assert [r["hook_calls"] for r in ranks] == [4, 4]  # not 12: DDP's no_sync on the others


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", ["spawn", "fork"])
def test_registered_with_spawn_and_fork_launchers(tmp_path: Path, launcher: str) -> None:
    ranks = run_script("powersgd_ddp.py", tmp_path, "--steps", "6", "--launcher", launcher)
    for rank in ranks:
        assert rank["launcher"] == "_MultiProcessingLauncher"
        assert rank["hook_calls"] == 6
        assert rank["ratio"] == 32.0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_converges_close_to_plain_ddp_and_half_precision_runs_on_gloo(tmp_path: Path) -> None:
    def last_loss(strategy: str, **kw: str) -> tuple[float, dict[str, Any]]:
        ranks = run_script("powersgd_ddp.py", tmp_path / strategy, "--strategy", strategy,
                           "--steps", "120", "--start-iter", "10")  # fmt: skip
        return ranks[0]["last_loss"], ranks[0]

    plain, plain_rank = last_loss("ddp")
    powersgd, _ = last_loss("ddp_powersgd")
    start = plain_rank["first_loss"]
    assert plain < 0.25 * start
    assert powersgd < 0.25 * start
    assert powersgd < 2.0 * plain
    for half in ("ddp_fp16_compress", "ddp_bf16_compress"):
        loss, rank = last_loss(half)
        assert rank["hook_calls"] == 120  # the hook really ran, on gloo, bf16 included
        assert loss == pytest.approx(plain, rel=0.05)


def test_compression_ratio_is_logged_from_the_live_state() -> None:
    from lightning_speedkit.distributed.powersgd import _PowerSGDCheckpoint

    class Recorder:
        def __init__(self) -> None:
            self.rows: list[tuple[int, dict[str, float]]] = []

        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            self.rows.append((step, metrics))

    strategy = DDPPowerSGDStrategy(start_iter=2)
    state = PowerSGDState(None, start_powerSGD_iter=2)
    state.total_numel_before_compression, state.total_numel_after_compression = 4096 * 10, 128 * 10
    strategy._book = _ParameterBook(state, {})
    recorder = Recorder()
    trainer = type("T", (), {"loggers": [recorder], "global_step": 50, "log_every_n_steps": 50})()
    _PowerSGDCheckpoint(strategy).on_train_batch_end(trainer)  # type: ignore[arg-type]
    assert recorder.rows == [(50, {"powersgd/compression_ratio": 32.0})]
    trainer.global_step = 51  # type: ignore[attr-defined]
    _PowerSGDCheckpoint(strategy).on_train_batch_end(trainer)  # type: ignore[arg-type]
    assert len(recorder.rows) == 1  # only every log_every_n_steps
