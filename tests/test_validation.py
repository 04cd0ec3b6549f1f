"""Every bad input to the public API: one line naming the argument, the value and the fix.

One table over every public class and function (``lightning_speedkit.__all__``): each row
calls it with one bad argument and checks that a ``SpeedkitConfigError`` is raised at
once (construction, not ``fit``), that its message is a single line, names the argument
in backticks, shows the value received, and says what the row expects (the fix).
Then the checkers themselves: what they accept, and what they give back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import lightning_speedkit as kit
from lightning_speedkit import SpeedkitConfigError, _validation
from lightning_speedkit.distributed.plan_memory import plan_memory
from tests.helpers.models import loader

NAN, INF = float("nan"), float("inf")


class _Data(kit.SpeedDataModuleMixin, L.LightningDataModule):
    pass


def _speed_dataloader(**kwargs: Any) -> Any:
    return _Data().speed_dataloader(TensorDataset(torch.arange(8)), **kwargs)


def _tune(**kwargs: Any) -> Any:
    return kit.tune_num_workers(loader(), **{"progress": False, "cache": False, **kwargs})


def _forward(ctx: Any, x: Any) -> Any:
    return x


@dataclass(frozen=True)
class Row:
    target: str
    """The public name the row is about (for the coverage check)."""
    call: Callable[[], object]
    argument: str
    shown: str
    """The bad value as the message must show it (its repr)."""
    expect: tuple[str, ...] = ()


def row(
    target: str,
    call: Callable[[], object],
    argument: str,
    value: Any,
    *expect: str,
    marks: tuple[Any, ...] = (),
) -> Any:
    shown = repr(value)
    # A component whose class is not in this checkout yet: its rows wait for it.
    missing = pytest.mark.skipif(not hasattr(kit, target), reason=f"no {target} here yet")
    return pytest.param(
        Row(target, call, argument, shown, expect),
        id=f"{target}-{argument}-{shown}",
        marks=[missing, *marks],
    )


S = "not the string"

ROWS = [
    # -- the examples of the issue ------------------------------------------------------------
    row("ProfilerSchedule", lambda: kit.ProfilerSchedule(max_trace_mb="10"), "max_trace_mb", "10",
        f"{S} '10'", "e.g. 10,"),
    row("NumWorkersTuner", lambda: kit.NumWorkersTuner(timeout="30"), "timeout", "30",
        f"{S} '30'"),
    row("DDPPowerSGDStrategy", lambda: kit.DDPPowerSGDStrategy(min_compression_rate="2"),
        "min_compression_rate", "2", f"{S} '2'"),
    row("DeepSpeedZeRO2Strategy", lambda: kit.DeepSpeedZeRO2Strategy(bucket_size="1e6"),
        "bucket_size", "1e6", "e.g. 1000000, not the string '1e6'"),
    row("AttentionSwap", lambda: kit.AttentionSwap(tolerance="1e-3"), "tolerance", "1e-3",
        "e.g. 0.001, not the string '1e-3'"),
    row("AccumulationScheduler", lambda: kit.AccumulationScheduler(64, comm_threshold="0.3"),
        "comm_threshold", "0.3", f"{S} '0.3'"),
    row("NumWorkersTuner", lambda: kit.NumWorkersTuner(timeout=NAN), "timeout", NAN, "finite"),
    row("NumWorkersTuner", lambda: kit.NumWorkersTuner(time_budget=NAN), "time_budget", NAN,
        "finite"),
    row("tune_num_workers", lambda: _tune(timeout=NAN), "timeout", NAN, "finite"),
    row("tune_num_workers", lambda: _tune(time_budget=NAN), "time_budget", NAN, "finite"),
    row("DDPPowerSGDStrategy", lambda: kit.DDPPowerSGDStrategy(min_compression_rate=NAN),
        "min_compression_rate", NAN, "finite"),
    row("DeepSpeedZeRO2Strategy", lambda: kit.DeepSpeedZeRO2Strategy(bucket_size=NAN),
        "bucket_size", NAN, "integer"),
    row("plan_memory", lambda: plan_memory(INF, 8), "n_params", INF, "finite"),
    row("SpeedMonitor", lambda: kit.SpeedMonitor(peak_flops=True), "peak_flops", True, "a bool"),
    row("SpeedMonitor", lambda: kit.SpeedMonitor(peak_flops=-1e12), "peak_flops", -1e12,
        "positive"),
    row("peak_flops", lambda: kit.peak_flops("Mystery", overrides={"Mystery": -1e12}),
        "overrides['Mystery']", -1e12, "positive"),
    row("register_adapter", lambda: kit.register_adapter("mine", None, _forward), "match", None,
        "must be a function"),
    row("register_adapter", lambda: kit.register_adapter(3, print, _forward), "family", 3,
        "non-empty string"),
    row("register_adapter", lambda: kit.register_adapter("timm", print, _forward), "family",
        "timm", "built-in family", "choose another name"),
    row("DDPPowerSGDStrategy", lambda: kit.DDPPowerSGDStrategy(find_unused_parameter=True),
        "find_unused_parameter", True, "did you mean `find_unused_parameters`"),
    row("DDPHalfPrecisionStrategy", lambda: kit.DDPHalfPrecisionStrategy(bucket_cap=25),
        "bucket_cap", 25, "did you mean `bucket_cap_mb`", "accepts"),
    row("DeepSpeedZeRO2Strategy", lambda: kit.DeepSpeedZeRO2Strategy(overlap_com=True),
        "overlap_com", True, "did you mean `overlap_comm`"),
    row("FSDPZeRO2Strategy", lambda: kit.FSDPZeRO2Strategy(limit_allgathers=False),
        "limit_allgathers", False, "did you mean `limit_all_gathers`"),
    row("ActivationCheckpointing", lambda: kit.ActivationCheckpointing(blocks="nonexistent"),
        "blocks", "nonexistent", "`blocks=['nonexistent']`"),
    # -- the rest of each class and function -------------------------------------------------
    row("SpeedMonitor", lambda: kit.SpeedMonitor(log_every_n_steps=0), "log_every_n_steps", 0,
        ">= 1"),
    row("SpeedMonitor", lambda: kit.SpeedMonitor(window=2.5), "window", 2.5, "integer"),
    row("SpeedMonitor", lambda: kit.SpeedMonitor(peak_flops="fast"), "peak_flops", "fast",
        "'auto', 'measure'"),
    row("SpeedMonitor", lambda: kit.SpeedMonitor(tokens_per_batch=128), "tokens_per_batch", 128,
        "lambda batch: 128"),
    row("ProfilerSchedule", lambda: kit.ProfilerSchedule(active=0), "active", 0, ">= 1"),
    row("ProfilerSchedule", lambda: kit.ProfilerSchedule(wait=2.0), "wait", 2.0, "`wait=2`"),
    row("ProfilerSchedule", lambda: kit.ProfilerSchedule(with_stack="false"), "with_stack",
        "false", "`with_stack=False`"),
    row("ProfilerSchedule", lambda: kit.ProfilerSchedule(dirpath=3), "dirpath", 3, "path"),
    row("NumWorkersTuner", lambda: kit.NumWorkersTuner(max_workers=-1), "max_workers", -1,
        ">= 0"),
    row("NumWorkersTuner", lambda: kit.NumWorkersTuner(min_gain=-0.1), "min_gain", -0.1, ">= 0"),
    row("NumWorkersTuner", lambda: kit.NumWorkersTuner(cache="yes"), "cache", "yes",
        "True or False"),
    row("NumWorkersTuner", lambda: kit.NumWorkersTuner(compute_threads=0), "compute_threads", 0,
        ">= 1"),
    row("NumWorkersTuner", lambda: kit.NumWorkersTuner(verdict_steps=-1), "verdict_steps", -1,
        "0 turns the verdict off"),
    row("tune_num_workers", lambda: kit.tune_num_workers([1, 2]), "dataloader", [1, 2],
        "DataLoader"),
    row("tune_num_workers", lambda: _tune(batches=0), "batches", 0, ">= 1"),
    row("tune_num_workers", lambda: _tune(local_world_size=0), "local_world_size", 0, ">= 1"),
    row("tune_num_workers", lambda: _tune(min_seconds=-1), "min_seconds", -1, ">= 0"),
    row("SpeedDataModuleMixin", lambda: _speed_dataloader(batch_size=0), "batch_size", 0,
        ">= 1"),
    row("SpeedDataModuleMixin", lambda: _speed_dataloader(batch_size=4, shuffle=1), "shuffle",
        1, "True or False"),
    row("SpeedDataModuleMixin", lambda: _speed_dataloader(batch_size=4, cache=-5), "cache", -5,
        "bytes"),
    row("AttentionSwap", lambda: kit.AttentionSwap(tolerance=0.0), "tolerance", 0.0, "positive"),
    row("AttentionSwap", lambda: kit.AttentionSwap(verbose=None), "verbose", None,
        "True or False"),
    row("AttentionSwap", lambda: kit.AttentionSwap("flash2"), "backend='flash2'", "flash2",
        "Choose one of"),
    row("swap_attention", lambda: kit.swap_attention("model"), "model", "model",
        "nn.Module"),
    row("swap_attention", lambda: kit.swap_attention(nn.Linear(2, 2), tolerance=INF),
        "tolerance", INF, "finite"),
    row("register_adapter", lambda: kit.register_adapter("mine", print, "forward"), "forward",
        "forward", "ctx.attend"),
    row("AccumulationScheduler", lambda: kit.AccumulationScheduler(target_global_batch="64"),
        "target_global_batch", "64", f"{S} '64'"),
    row("AccumulationScheduler", lambda: kit.AccumulationScheduler(64, lr_scaling="linar"),
        "lr_scaling", "linar", "did you mean `lr_scaling='linear'`"),
    row("AccumulationScheduler", lambda: kit.AccumulationScheduler(64, adaptive="false"),
        "adaptive", "false", "`adaptive=False`"),
    row("AccumulationScheduler", lambda: kit.AccumulationScheduler(schedule={0: 0}),
        "schedule[0]", 0, ">= 1"),
    row("ActivationCheckpointing", lambda: kit.ActivationCheckpointing(fraction=1.5), "fraction",
        1.5, "(0, 1]"),
    row("ActivationCheckpointing", lambda: kit.ActivationCheckpointing(blocks=[]), "blocks", [],
        '"auto"'),
    row("ActivationCheckpointing", lambda: kit.ActivationCheckpointing(blocks=[3]), "blocks", 3,
        "module classes or names"),
    row("DDPPowerSGDStrategy", lambda: kit.DDPPowerSGDStrategy(rank=0), "rank", 0,
        "start with 1"),
    row("DDPPowerSGDStrategy", lambda: kit.DDPPowerSGDStrategy(error_feedback="no"),
        "error_feedback", "no", "True or False"),
    row("DDPPowerSGDStrategy", lambda: kit.DDPPowerSGDStrategy(seed=-1), "seed", -1,
        "4294967295"),
    row("DDPPowerSGDStrategy", lambda: kit.DDPPowerSGDStrategy(compress_dtype="fp8"),
        "compress_dtype", "fp8", "'fp16', 'bf16'"),
    row("DDPHalfPrecisionStrategy", lambda: kit.DDPHalfPrecisionStrategy("bf17"),
        "compress_dtype", "bf17", "did you mean `compress_dtype='bf16'`"),
    row("DeepSpeedZeRO2Strategy", lambda: kit.DeepSpeedZeRO2Strategy(offload_optimizer=1),
        "offload_optimizer", 1, "True or False"),
    row("FSDPZeRO2Strategy", lambda: kit.FSDPZeRO2Strategy(sharding_strategy="shard_grad"),
        "sharding_strategy", "shard_grad", "did you mean `sharding_strategy='SHARD_GRAD_OP'`"),
    row("FSDPZeRO2Strategy", lambda: kit.FSDPZeRO2Strategy(auto_wrap_policy="blocks"),
        "auto_wrap_policy", "blocks", '"auto"'),
    row("plan_memory", lambda: plan_memory(7e9, 8.0), "n_devices", 8.0, "`n_devices=8`"),
    row("plan_memory", lambda: plan_memory("7e9", 8), "n_params", "7e9", f"{S} '7e9'"),
    row("plan_memory", lambda: plan_memory(7e9, 8, trainable_params=NAN), "trainable_params",
        NAN, "finite"),
    row("plan_memory", lambda: plan_memory(7e9, 8, optimizer="adam_w"), "optimizer", "adam_w",
        "did you mean `optimizer='adamw'`"),
    row("plan_memory", lambda: plan_memory(7e9, 8, n_heads=0), "n_heads", 0, ">= 1"),
    row("plan_memory", lambda: plan_memory(1e6, 1).fits(NAN), "device_memory", NAN, "finite"),
    row("plan_memory", lambda: plan_memory(1e6, 1).per_device("zero4"), "name", "zero4",
        "not a planned strategy"),
    row("peak_flops", lambda: kit.peak_flops("NVIDIA H100", "fp12"), "dtype", "fp12",
        "'fp16'"),
    row("peak_flops", lambda: kit.peak_flops(0), "device", 0, "device"),
    row("peak_flops", lambda: kit.peak_flops("NVIDIA H100", measure="yes"), "measure", "yes",
        "True or False"),
    row("count_flops", lambda: kit.count_flops(3), "fn", 3, "lambda"),
    # -- public classes of the other components: the same contract ------------------------------
    row("FSDP2ZeRO2Strategy", lambda: kit.FSDP2ZeRO2Strategy(blocks="nope"), "blocks", "nope"),
    row("FSDP2ZeRO2Strategy", lambda: kit.FSDP2ZeRO2Strategy(foo=1), "foo", 1, "accepts"),
    row("MicroBatchTuner", lambda: kit.MicroBatchTuner(max_micro_batch=0), "max_micro_batch", 0),
    row("RegionalCompile", lambda: kit.RegionalCompile(blocks="x"), "blocks", "x"),
    row("HangWatchdog", lambda: kit.HangWatchdog(timeout="30"), "timeout", "30", f"{S} '30'"),
    row("FusedOptimizer", lambda: kit.FusedOptimizer(verbose="no"), "verbose", "no"),
    # -- the Trainer-free cores of the compute and memory levers ------------------------------
    row("tune_micro_batch", lambda: kit.tune_micro_batch("model", _loader(), print), "model",
        "model", "torch.nn.Module"),
    row("tune_micro_batch", lambda: kit.tune_micro_batch(nn.Linear(2, 2), _loader(), print,
        memory_headroom=NAN), "memory_headroom", NAN, "finite"),
    row("compile_blocks", lambda: kit.compile_blocks("model"), "model", "model",
        "torch.nn.Module"),
    row("compile_blocks", lambda: kit.compile_blocks(nn.Linear(2, 2), blocks="x"), "blocks", "x",
        "blocks=['x']"),
    row("checkpoint_blocks", lambda: kit.checkpoint_blocks("model"), "model", "model",
        "torch.nn.Module"),
    row("checkpoint_blocks", lambda: kit.checkpoint_blocks(nn.Linear(2, 2), fraction=1.5),
        "fraction", 1.5, "(0, 1]"),
    row("cache_frozen_features", lambda: kit.cache_frozen_features("model"), "model", "model",
        "torch.nn.Module"),
    row("cache_frozen_features", lambda: kit.cache_frozen_features(nn.Linear(2, 2),
        modules=["nope"]), "modules", "nope", "has no submodules"),
    row("FrozenFeatureCache", lambda: kit.FrozenFeatureCache(budget="lots"), "budget", "lots",
        "budget='50%'"),
    row("FrozenFeatureCache", lambda: kit.FrozenFeatureCache(key=3), "key", 3, "key='index'"),
    row("packed_documents", lambda: _packed(cu_seqlens=torch.tensor([0, 3, 2])), "cu_seqlens",
        [0, 3, 2], "never decrease", "PackingCollate"),
    row("packed_documents", lambda: _packed(cu_seqlens=torch.tensor([0, 3, 4])), "cu_seqlens",
        [0, 3, 4], "must end at the 1 x 5 = 5 tokens", "document_ids"),
    row("fuse_optimizers", lambda: kit.fuse_optimizers("opt"), "optimizers", "opt",
        "fuse_optimizers([optimizer])"),
]  # fmt: skip


def _packed(**fields: Any) -> None:
    with kit.packed_documents({"input_ids": torch.zeros(1, 5, dtype=torch.long), **fields}):
        pass


def _loader() -> torch.utils.data.DataLoader[Any]:
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 2)),
                                       batch_size=4)  # fmt: skip


#: Public names with no argument to check.
NOTHING_TO_CHECK = {"__version__", "SpeedkitConfigError", "FlopCount"}


@pytest.mark.parametrize("case", ROWS)
def test_bad_input_is_one_line_naming_the_argument_the_value_and_the_fix(case: Row) -> None:
    with pytest.raises(SpeedkitConfigError) as info:
        case.call()
    message = str(info.value)
    assert "\n" not in message
    assert f"`{case.argument}`" in message
    assert case.shown in message
    for expected in case.expect:
        assert expected in message


def test_every_public_class_and_function_has_rows() -> None:
    covered = {param.values[0].target for param in ROWS}
    public = {name for name in kit.__all__ if name not in NOTHING_TO_CHECK}
    assert public - covered == set(), "add rows for these to ROWS"


def test_a_keyword_the_parent_strategy_takes_is_still_accepted() -> None:
    ddp = kit.DDPPowerSGDStrategy(
        find_unused_parameters=True, static_graph=True, bucket_cap_mb=25,
        gradient_as_bucket_view=True, process_group_backend="gloo", start_method="spawn",
        model_averaging_period=None, ddp_comm_hook=None,  # LightningCLI passes the defaults
    )  # fmt: skip
    assert ddp._ddp_kwargs["bucket_cap_mb"] == 25
    assert kit.DDPHalfPrecisionStrategy("bf16", static_graph=True)._ddp_kwargs == {
        "static_graph": True,
        "gradient_as_bucket_view": True,
    }
    fsdp = kit.FSDPZeRO2Strategy(
        limit_all_gathers=False, use_orig_params=True, state_dict_type="sharded",
        cpu_offload=False, sharding_strategy="shard_grad_op", forward_prefetch=True,
    )  # fmt: skip
    assert fsdp.kwargs["limit_all_gathers"] is False
    assert fsdp.kwargs["forward_prefetch"] is True


@pytest.mark.deepspeed
def test_a_keyword_deepspeed_strategy_takes_is_still_accepted() -> None:
    strategy = kit.DeepSpeedZeRO2Strategy(
        bucket_size=np.int64(2**20), logging_level=30, offload_optimizer_device="cpu",
        allgather_bucket_size=10**6,
    )  # fmt: skip
    assert strategy.bucket_size == 2**20
    assert type(strategy.bucket_size) is int


def test_valid_values_are_accepted_as_users_write_them() -> None:
    """Ints where floats are asked, numpy scalars, and what each check gives back."""
    assert kit.ProfilerSchedule(max_trace_mb=10, active=np.int64(2)).max_trace_mb == 10.0
    assert kit.NumWorkersTuner(timeout=30, time_budget=np.float32(60)).tune_kwargs["timeout"] == 30
    assert kit.AttentionSwap(tolerance=np.float64(1e-3)).tolerance == 1e-3
    assert kit.AccumulationScheduler(np.int64(64), comm_threshold=np.float32(0.25)).comm_threshold
    assert kit.DDPPowerSGDStrategy(min_compression_rate=2, rank=np.int64(2)).rank == 2
    assert kit.SpeedMonitor(peak_flops=np.float64(1e14)).peak_flops == 1e14
    assert kit.SpeedMonitor(peak_flops=100).peak_flops == 100
    assert kit.ActivationCheckpointing(fraction=1).fraction == 1.0
    plan = plan_memory(np.int64(10**6), np.int64(2), trainable_params=np.float32(5e5))
    assert (plan.n_params, plan.n_devices, plan.trainable_params) == (10**6, 2, 500_000)
    assert plan.fits(80 * 2**30, headroom=np.float64(0.9))
    assert kit.peak_flops("Mystery", overrides={"Mystery": 10**14}) == 1e14


@pytest.mark.parametrize(
    ("check", "value", "expected"),
    [
        (lambda v: _validation.positive_number("x", v), 3, 3.0),
        (lambda v: _validation.positive_number("x", v), np.float32(0.5), 0.5),
        (lambda v: _validation.positive_number("x", v), np.int64(7), 7.0),
        (lambda v: _validation.non_negative_number("x", v), 0, 0.0),
        (lambda v: _validation.probability("x", v), 1, 1.0),
        (lambda v: _validation.probability("x", v), 0.0, 0.0),
        (lambda v: _validation.number("x", v, low=1), 1, 1.0),
        (lambda v: _validation.number("x", v, low=1, high=2, high_open=True), 1.5, 1.5),
        (lambda v: _validation.positive_int("x", v), np.int32(4), 4),
        (lambda v: _validation.non_negative_int("x", v), 0, 0),
        (lambda v: _validation.integer("x", v, at_least=-3, at_most=3), -3, -3),
        (lambda v: _validation.boolean("x", v), np.bool_(True), True),
        (lambda v: _validation.boolean("x", v), False, False),
        (lambda v: _validation.choice("x", v, ("a", None)), None, None),
        (lambda v: _validation.choice("x", v, ("a", None)), "a", "a"),
        (lambda v: _validation.optional(_validation.positive_int, "x", v), None, None),
        (lambda v: _validation.text("x", v, example="e"), "name", "name"),
        (lambda v: _validation.path("x", v), "runs", "runs"),
        (lambda v: _validation.function("x", v, fix="f"), print, print),
    ],
)
def test_each_check_accepts_valid_values(
    check: Callable[[Any], Any], value: Any, expected: Any
) -> None:
    got = check(value)
    assert got == expected
    assert type(got) is type(expected)  # a Python int/float/bool, not a numpy scalar


@pytest.mark.parametrize(
    ("check", "value", "expected"),
    [
        (lambda v: _validation.positive_number("x", v), True, "`x` must be a positive number, "
         "got True (a bool); pass a number, e.g. `x=1`."),
        (lambda v: _validation.positive_number("x", v), "10", "`x` must be a positive number, "
         "got '10' (a string); pass a number, e.g. 10, not the string '10'."),
        (lambda v: _validation.positive_number("x", v), "ten", "`x` must be a positive number, "
         "got 'ten' (a string); pass a number, e.g. `x=1`."),
        (lambda v: _validation.positive_number("x", v), -INF, "`x` must be a finite positive "
         "number, got -inf; pass e.g. `x=1`."),
        (lambda v: _validation.probability("x", v), 1.5, "`x` must be a number in [0, 1], got "
         "1.5; pass e.g. `x=0`."),
        (lambda v: _validation.positive_int("x", v), 2.0, "`x` must be an integer >= 1, got 2.0; "
         "pass `x=2`."),
        (lambda v: _validation.positive_int("x", v), "1e6", "`x` must be an integer >= 1, got "
         "'1e6' (a string); pass a number, e.g. 1000000, not the string '1e6'."),
        (lambda v: _validation.boolean("x", v), "false", "`x` must be True or False, got 'false' "
         "(a string); pass `x=False`, not the string 'false' (any non-empty string is true)."),
        (lambda v: _validation.boolean("x", v), 1, "`x` must be True or False, got 1; pass "
         "`x=True` or `x=False`."),
        (lambda v: _validation.choice("x", v, (0, 1)), True, "`x` is not one of the choices, got "
         "True (a bool); pass one of 0, 1."),
        (lambda v: _validation.choice("x", v, ("adam", "sgd")), "Adam", "`x` is not one of the "
         "choices, got 'Adam' (a string); did you mean `x='adam'`? The choices are 'adam', "
         "'sgd'."),
        (lambda v: _validation.instance("x", v, int, what="an int", fix="pass 1"),
         nn.Sequential(nn.Linear(1, 1)), "`x` must be an int, got a Sequential object; pass 1."),
    ],
)  # fmt: skip
def test_each_check_says_what_was_wrong_and_the_fix(
    check: Callable[[Any], Any], value: Any, expected: str
) -> None:
    with pytest.raises(SpeedkitConfigError) as info:
        check(value)
    assert str(info.value) == expected


def test_keywords_are_checked_against_the_signatures_they_flow_into() -> None:
    def parent(self: Any, alpha: int = 1, *, beta_gamma: int = 2, **rest: Any) -> None: ...

    def child(module: Any, delta: int = 3) -> None: ...

    accepted = _validation.accepted_keywords(parent, child, exclude=("module",))
    assert accepted == {"alpha", "beta_gamma", "delta"}
    _validation.check_keywords("Thing", {"alpha": 1, "delta": 4}, accepted)
    with pytest.raises(SpeedkitConfigError) as info:
        _validation.check_keywords("Thing", {"beta_gama": math.pi}, accepted)
    assert str(info.value) == (
        f"`beta_gama` is not an argument of Thing, got {math.pi!r}; did you mean `beta_gamma`? "
        "Thing accepts alpha, beta_gamma, delta."
    )
