from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from lightning_speedkit import (
    DDPHalfPrecisionStrategy,
    DDPPowerSGDStrategy,
    SpeedkitConfigError,
    _compat,
)
from lightning_speedkit.distributed._kit_ddp import _KitDDPStrategy
from lightning_speedkit.distributed._powersgd_state import _ParameterBook
from lightning_speedkit.distributed.powersgd import _PowerSGDCheckpoint

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
    for name in ("ddp_powersgd", "ddp_fp16_compress", "ddp_bf16_compress"):
        named = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False).strategy
        assert named._ddp_kwargs["gradient_as_bucket_view"] is True  # type: ignore[attr-defined]


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


def _params(out: Path, rank: int) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = torch.load(out / f"params{rank}.pt", weights_only=True)
    return loaded


def _max_diff(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> float:
    return max(float((x[k] - y[k]).abs().max()) for k in x)


@pytest.mark.multiprocess
@pytest.mark.parametrize("buckets", ["one", "per-parameter"])
def test_compresses_on_gloo_and_resumes_exactly(tmp_path: Path, buckets: str) -> None:
    """With one bucket, and with a bucket per parameter (which DDP re-lays after its
    first iteration, and whose collectives gloo must keep in order). The one-bucket run
    starts as a user's job does (``python script.py``, Lightning's launcher starting
    rank 1), not from the suite's warm interpreter."""
    cap = ["--bucket-cap-mb", "25" if buckets == "one" else "0.01"]
    whole = run_script("powersgd_ddp.py", tmp_path / "whole", "--steps", "12",
                       "--save-every", "6", *cap, fresh=buckets == "one")  # fmt: skip
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

    if buckets == "per-parameter":
        return  # what follows judges the checkpoint, not the bucket layout: once is enough
    # The same resume without the saved PowerSGD state does not end where the whole run did.
    stripped = torch.load(checkpoint, weights_only=True)
    del stripped["callbacks"]["DDPPowerSGDStrategy"]
    torch.save(stripped, tmp_path / "stripped.ckpt")
    run_script("powersgd_ddp.py", tmp_path / "fresh", "--steps", "12", "--resume",
               str(tmp_path / "stripped.ckpt"), *cap)  # fmt: skip
    assert _max_diff(_params(tmp_path / "whole", 0), _params(tmp_path / "fresh", 0)) > 1e-4


@pytest.mark.multiprocess
@pytest.mark.parametrize(("start_iter", "warm_start"), [(6, 1), (2, 0)])
def test_resumes_exactly_at_the_first_compressed_iteration_and_without_warm_start(
    tmp_path: Path, start_iter: int, warm_start: int
) -> None:
    """The resumed process's first iteration runs on DDP's first bucket layout, which the
    run it continues had left: the initial factors, drawn per parameter, do not depend on
    it. Torch's per-bucket draws gave the 64x64 matrices other factors there (a bucket per
    parameter: its order changes)."""
    args = ["--bucket-cap-mb", "0.01", "--start-iter", str(start_iter),
            "--warm-start", str(warm_start)]  # fmt: skip
    run_script("powersgd_ddp.py", tmp_path / "whole", "--steps", "10", "--save-every", "6", *args)
    checkpoint = tmp_path / "whole" / "ckpt" / "epoch=0-step=6.ckpt"
    resumed = run_script("powersgd_ddp.py", tmp_path / "resumed", "--steps", "10", "--resume",
                         str(checkpoint), *args)  # fmt: skip
    assert [r["powersgd_iter"] for r in resumed] == [10, 10]
    for rank in (0, 1):
        assert (
            _max_diff(_params(tmp_path / "whole", rank), _params(tmp_path / "resumed", rank)) == 0.0
        )


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", ["spawn", "fork"])
def test_registered_with_spawn_and_fork_launchers_and_run_only_on_sync_steps(
    tmp_path: Path, launcher: str
) -> None:
    ranks = run_script("powersgd_ddp.py", tmp_path, "--steps", "6", "--accumulate", "3",
                       "--launcher", launcher)  # fmt: skip
    for rank in ranks:
        assert rank["launcher"] == "_MultiProcessingLauncher"
        assert rank["global_step"] == 6
        assert rank["hook_calls"] == 6  # not 18: DDP's no_sync on the other micro-batches
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


def test_compression_ratio_is_logged_from_the_live_state(monkeypatch: pytest.MonkeyPatch) -> None:
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
    trainer = type("T", (), {"loggers": [recorder], "logs_now": True})()
    # Lightning's cadence and step, as the fit loop gives them (see _compat)
    monkeypatch.setattr(_compat, "lightning_logs_now", lambda trainer: trainer.logs_now)
    monkeypatch.setattr(_compat, "logged_step", lambda trainer: 49)
    _PowerSGDCheckpoint(strategy).on_train_batch_end(trainer)  # type: ignore[arg-type]
    assert recorder.rows == [(49, {"powersgd/compression_ratio": 32.0})]
    trainer.logs_now = False  # type: ignore[attr-defined]
    _PowerSGDCheckpoint(strategy).on_train_batch_end(trainer)  # type: ignore[arg-type]
    assert len(recorder.rows) == 1  # only where Lightning writes its rows


# --- gradients as bucket views, DDP settings, Adam-family warning ----------------------------


@pytest.mark.parametrize("cls", [DDPPowerSGDStrategy, DDPHalfPrecisionStrategy])
def test_ddp_settings_are_passed_to_ddp_and_checked(cls: type[_KitDDPStrategy]) -> None:
    assert cls()._ddp_kwargs == {"gradient_as_bucket_view": True}
    chosen = cls(gradient_as_bucket_view=False, bucket_cap_mb=50, static_graph=True)
    assert chosen._ddp_kwargs == {
        "gradient_as_bucket_view": False, "bucket_cap_mb": 50.0, "static_graph": True,
    }  # fmt: skip
    bad = [({"bucket_cap_mb": 0}, "bucket_cap_mb"), ({"bucket_cap_mb": "25"}, "bucket_cap_mb"),
           ({"gradient_as_bucket_view": "yes"}, "gradient_as_bucket_view"),
           ({"static_graph": 1}, "static_graph"), ({"ddp_comm_hook": print}, "ddp_comm_hook"),
           ({"bucket_cap": 25}, "bucket_cap")]  # fmt: skip
    for kwargs, argument in bad:
        with pytest.raises(SpeedkitConfigError, match=f"`{argument}`"):
            cls(**kwargs)


def test_static_graph_with_accumulation_is_refused_at_setup() -> None:
    # torch's DDP fails an internal assertion in the first accumulated backward otherwise
    strategy = DDPHalfPrecisionStrategy("fp16", static_graph=True)
    trainer: Any = SimpleNamespace(accumulate_grad_batches=2)
    with pytest.raises(SpeedkitConfigError, match=r"`static_graph`.*accumulate_grad_batches=2"):
        strategy.setup(trainer)


@pytest.mark.parametrize(
    ("optimizer", "rank", "warns"),
    [("AdamW", 1, True), ("NAdam", 2, True), ("AdamW", 4, False), ("SGD", 1, False)],
)
def test_adam_family_below_rank_4_is_warned_at_setup(
    monkeypatch: pytest.MonkeyPatch, optimizer: str, rank: int, warns: bool
) -> None:
    monkeypatch.setattr(DDPStrategy, "setup", lambda self, trainer: None)  # no process group
    strategy = DDPPowerSGDStrategy(rank=rank)
    params = [torch.nn.Parameter(torch.zeros(2))]
    strategy.optimizers = [getattr(torch.optim, optimizer)(params, lr=0.1)]
    trainer: Any = SimpleNamespace(accumulate_grad_batches=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy.setup(trainer)
    messages = [str(w.message) for w in caught if "DDPPowerSGDStrategy" in str(w.message)]
    if not warns:
        assert messages == []
        return
    (message,) = messages
    assert f"`rank`={rank} with {optimizer}" in message
    assert "DDPPowerSGDStrategy(rank=4)" in message
    assert "benchmarks/powersgd_rank.py" in message


@pytest.mark.multiprocess
def test_gradients_stay_bucket_views_and_hold_4_bytes_per_parameter_less(
    tmp_path: Path,
) -> None:
    """Two AdamW ranks with gradient accumulation: the kit's default holds what
    plan_memory(gradient_as_bucket_view=True) plans, 4 bytes per parameter less than
    gradient_as_bucket_view=False, and less than Lightning's own
    DDPStrategy(gradient_as_bucket_view=True), whose first buckets meet the rebuilt ones
    (the peak the kit avoids). Same losses and weights as with a copy of the gradients."""
    from lightning_speedkit.distributed import plan_memory

    common = ["--measure-memory", "--optimizer", "adamw", "--width", "256", "--depth", "16",
              "--steps", "4", "--accumulate", "2", "--start-iter", "100"]  # fmt: skip
    runs = {
        "view": run_script("powersgd_ddp.py", tmp_path / "view", *common),
        "copy": run_script(
            "powersgd_ddp.py", tmp_path / "copy", *common, "--gradient-as-bucket-view", "0"
        ),
        "lightning": run_script(
            "powersgd_ddp.py", tmp_path / "lightning", *common, "--strategy", "ddp_view"
        ),
    }
    psi = runs["view"][0]["n_params"]
    for rank in runs["view"]:
        assert rank["ddp_kwargs"]["gradient_as_bucket_view"] is True
        assert rank["released_before_rebuild"] is True
        assert rank["kept_views_in_no_sync"] is True
        assert rank["rebuilt_buckets"] is True
    peak = {name: max(r["peak_bytes"] for r in ranks) for name, ranks in runs.items()}

    def planned(view: bool) -> int:
        plan = plan_memory(psi, 2, optimizer="adamw", precision="fp32", device="cpu",
                           gradient_as_bucket_view=view)  # fmt: skip
        return plan.per_device("ddp").total

    # the plan leaves out the activations and AdamW's per-tensor temporaries (~1 byte)
    assert peak["view"] == pytest.approx(planned(True), rel=0.1)
    assert peak["copy"] == pytest.approx(planned(False), rel=0.1)
    assert peak["copy"] - peak["view"] == pytest.approx(4 * psi, rel=0.05)
    # Lightning's: the first buckets beside the rebuilt ones, then, with accumulation,
    # gradients beside the buckets in every window's first micro-batch
    assert peak["lightning"] - peak["view"] > 3.5 * psi

    # numerics: the same sums, whether the gradients are views or copies
    assert runs["view"][0]["losses"] == runs["copy"][0]["losses"]
    for rank in (0, 1):
        assert _max_diff(_params(tmp_path / "view", rank), _params(tmp_path / "copy", rank)) == 0
    warned = [w for w in runs["view"][0]["warnings"] if "DDPPowerSGDStrategy" in w]
    assert len(warned) == 1  # rank 0 only
    assert "`rank`=1 with AdamW" in warned[0]
    assert not [w for w in runs["view"][1]["warnings"] if "DDPPowerSGDStrategy" in w]


@pytest.mark.multiprocess
def test_static_graph_frees_the_first_buckets_one_iteration_later(tmp_path: Path) -> None:
    common = ["--measure-memory", "--optimizer", "adamw", "--width", "256", "--depth", "16",
              "--steps", "4", "--start-iter", "100", "--rank", "4"]  # fmt: skip
    static = run_script("powersgd_ddp.py", tmp_path / "static", *common, "--static-graph")
    dynamic = run_script("powersgd_ddp.py", tmp_path / "dynamic", *common)
    for rank in static:
        assert rank["ddp_kwargs"]["static_graph"] is True
        assert rank["released_before_rebuild"] is True
        assert rank["rebuilt_buckets"] is True
        assert rank["warnings"] == [w for w in rank["warnings"] if "DDPPowerSGD" not in w]
    psi = static[0]["n_params"]
    peaks = [max(r["peak_bytes"] for r in ranks) for ranks in (static, dynamic)]
    assert peaks[0] == pytest.approx(peaks[1], abs=0.25 * psi)  # the same bytes
