"""The per-strategy byte accounting under plan_memory, on small exact counts.

1000 parameters of which 600 train, over 4 devices: every number below is the
docstring's formula worked by hand.
"""

from __future__ import annotations

import pytest

from lightning_speedkit.distributed._memory_estimates import (
    MemoryEstimate,
    ParamBytes,
    deepspeed_zero2,
    estimate_strategies,
    fsdp_zero2,
    paper_stages,
)

TOTAL, TRAINABLE, N = 1000, 600, 4
MIXED_ADAM = ParamBytes.of("adam", "mixed", "cuda")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("adam", "mixed", "cuda"), (2, 4, 8, 4, 4, True)),
        (("adamw", "mixed", "cpu"), (2, 4, 8, 0, 8, True)),  # single-tensor Adam on CPU
        (("adam", "fp32", "cuda"), (4, 0, 8, 4, 4, False)),
        (("adamw", "fp32", "cpu"), (4, 0, 8, 0, 8, False)),
        (("sgd", "mixed", "cuda"), (2, 4, 4, 0, 0, True)),  # momentum only, no temporaries
        (("sgd", "fp32", "cpu"), (4, 0, 4, 0, 0, False)),
    ],
)
def test_bytes_per_parameter(args: tuple[str, str, str], expected: tuple[object, ...]) -> None:
    size = ParamBytes.of(*args)
    got = (size.weight, size.master, size.moments, size.step_temp, size.flat_step_temp,
           size.mixed)  # fmt: skip
    assert got == expected


def test_paper_stages_partition_k_then_gradients_then_weights() -> None:
    rows = paper_stages(TOTAL, TRAINABLE, N, MIXED_ADAM, bucket_view=True)
    assert rows == {
        # 2 bytes of weights (all), 2 of gradients and K = 12 (trainable); foreach Adam's
        # sqrt(exp_avg_sq), 4 bytes of every trainable parameter
        "ddp": MemoryEstimate(params=2000, grads=1200, optimizer=7200, activations=0,
                              transient=2400),
        "zero1": MemoryEstimate(params=2000, grads=1200, optimizer=1800, activations=0,
                                transient=600),
        "zero2": MemoryEstimate(params=2000, grads=300, optimizer=1800, activations=0,
                                transient=600),
        "zero3": MemoryEstimate(params=500, grads=300, optimizer=1800, activations=0,
                                transient=600),
    }  # fmt: skip


def test_ddp_buckets_beside_the_gradients_unless_they_are_views() -> None:
    copies = paper_stages(TOTAL, TRAINABLE, N, MIXED_ADAM, bucket_view=False)
    views = paper_stages(TOTAL, TRAINABLE, N, MIXED_ADAM, bucket_view=True)
    assert copies["ddp"].buckets == 2400  # fp32, 4 bytes per trainable parameter
    assert views["ddp"].buckets == 0
    assert copies["ddp"].total - views["ddp"].total == 2400
    assert all(copies[name] == views[name] for name in ("zero1", "zero2", "zero3"))


def test_shares_round_up() -> None:
    rows = paper_stages(TOTAL, TRAINABLE, 3, MIXED_ADAM, bucket_view=True)
    assert rows["zero3"].params == 667  # 2000 / 3, rounded up


@pytest.mark.parametrize(("precision", "grads"), [("mixed", 900), ("fp32", 1200)])
def test_deepspeed_zero2(precision: str, grads: int) -> None:
    size = ParamBytes.of("adam", precision, "cuda")
    rows = deepspeed_zero2(TOTAL, TRAINABLE, N, size)
    weights = 2000 if precision == "mixed" else 4000
    # whole 16-bit (or fp32) weights, the fp32 weight partition; 16- and 32-bit gradient
    # partitions (two fp32 ones in fp32), the fp32 one only in the step
    assert rows["deepspeed_zero2"] == MemoryEstimate(
        params=weights + 600, grads=grads, optimizer=1200, activations=0, transient=600,
        step_only=600,
    )  # fmt: skip
    assert rows["deepspeed_zero2_offload"] == MemoryEstimate(
        params=weights,
        grads=0,
        optimizer=0,
        activations=0,
        host=14400,  # 600 x 16 x 1.5
    )


def test_offload_host_memory_grows_past_four_devices() -> None:
    rows = deepspeed_zero2(TOTAL, TRAINABLE, 8, MIXED_ADAM)
    assert rows["deepspeed_zero2_offload"].host == 28800  # 600 x (4 x 8) x 1.5


def test_fsdp_zero2_and_fsdp2_zero2() -> None:
    rows = fsdp_zero2(TOTAL, TRAINABLE, N, MIXED_ADAM)
    # the fp32 flat parameter sharded, the 16-bit compute copy whole from forward to backward
    assert rows["fsdp_zero2"] == MemoryEstimate(
        params=2000 + 1000, grads=600, optimizer=1200, activations=0, transient=600,
        compute_only=2000,
    )  # fmt: skip
    # fp32 shards, and every unit's parameters gathered in fp32
    assert rows["fsdp2_zero2"] == MemoryEstimate(
        params=1000 + 4000, grads=600, optimizer=1200, activations=0, transient=600,
        compute_only=4000,
    )  # fmt: skip
    assert rows["fsdp_zero2"].step_peak == 3000 + 600 + 1200 - 2000 + 600
    assert rows["fsdp_zero2"].compute_peak == 4800


def test_every_strategy_in_order() -> None:
    rows = estimate_strategies(TOTAL, TRAINABLE, N, MIXED_ADAM, bucket_view=False)
    assert list(rows) == ["ddp", "zero1", "zero2", "zero3", "deepspeed_zero2",
                          "deepspeed_zero2_offload", "fsdp_zero2", "fsdp2_zero2"]  # fmt: skip
    assert rows["ddp"].buckets == 2400
    assert rows["fsdp2_zero2"].params == 5000
