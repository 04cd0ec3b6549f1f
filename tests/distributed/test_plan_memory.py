"""plan_memory: the ZeRO paper's formulas, DeepSpeed's own estimator, activations, bad input."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_speedkit import SpeedkitConfigError
from lightning_speedkit.distributed.plan_memory import (
    PAPER,
    PRESETS,
    activation_bytes,
    count_parameters,
    plan_memory,
)

GIB = 2**30


@pytest.mark.parametrize("n", [1, 2, 3, 8, 64, 1024])
@pytest.mark.parametrize("psi", [1_000_000, 7_000_000_000])
def test_paper_stages_follow_the_zero_paper(psi: int, n: int) -> None:
    # Rajbhandari et al. 2020, Figure 1: mixed-precision Adam, K = 12.
    plan = plan_memory(psi, n)
    expected = {
        "ddp": (2 + 2 + 12) * psi,
        "zero1": 2 * psi + 2 * psi + 12 * psi / n,
        "zero2": 2 * psi + (2 + 12) * psi / n,
        "zero3": (2 + 2 + 12) * psi / n,
    }
    for name, bytes_ in expected.items():
        assert plan.per_device(name).model_states == pytest.approx(bytes_, abs=3)


def test_paper_example_7_5b_on_64_devices() -> None:
    # the paper's own numbers: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    plan = plan_memory(7.5e9, 64)
    got = [plan.per_device(name).model_states / 1e9 for name in PAPER]
    assert got == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.06)


@pytest.mark.deepspeed
@pytest.mark.parametrize("n", [1, 2, 8, 16, 64])
@pytest.mark.parametrize("psi", [10_000_000, 7_000_000_000])
def test_deepspeed_rows_agree_with_deepspeeds_estimator(psi: int, n: int) -> None:
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    plan = plan_memory(psi, n)
    _, gpu = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=n, cpu_offload=False)
    assert plan.per_device("deepspeed_zero2").model_states == pytest.approx(gpu, abs=4)
    cpu, gpu = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=n, cpu_offload=True)
    offload = plan.per_device("deepspeed_zero2_offload")
    assert offload.model_states == gpu
    assert offload.host == pytest.approx(cpu, abs=1)


def test_frozen_parameters_hold_no_gradients_or_optimizer_state() -> None:
    psi, trainable = 1_000_000, 250_000
    plan = plan_memory(psi, 4, trainable_params=trainable)
    ddp = plan.per_device("ddp")
    assert (ddp.params, ddp.grads, ddp.optimizer) == (2 * psi, 2 * trainable, 12 * trainable)
    frozen = plan_memory(psi, 4, trainable_params=0)
    for name in frozen.names:
        estimate = frozen.per_device(name)
        assert estimate.grads == estimate.optimizer == 0


def test_fp32_and_sgd() -> None:
    psi = 1_000_000
    fp32 = plan_memory(psi, 1, precision="fp32").per_device("ddp")
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4 * psi, 4 * psi, 8 * psi)
    sgd = plan_memory(psi, 1, optimizer="sgd").per_device("ddp")
    assert sgd.optimizer == (4 + 4) * psi  # fp32 master and momentum


def test_deepspeed_zero2_in_fp32_keeps_two_gradient_partitions() -> None:
    psi, n = 1_000_000, 4
    ds = plan_memory(psi, n, precision="fp32").per_device("deepspeed_zero2")
    # weights whole, the fp32 clone of the weight partition; the partition reduced into
    # and the flat copy the step makes; Adam's moments
    assert (ds.params, ds.grads, ds.optimizer) == (4 * psi + 4 * psi // n, 8 * psi // n,
                                                   8 * psi // n)  # fmt: skip


def test_fsdp_zero2_allocations() -> None:
    psi, n = 1_000_000, 4
    mixed = plan_memory(psi, n).per_device("fsdp_zero2")
    # bf16 compute copy whole; fp32 flat parameter, its gradient and Adam's moments sharded
    assert (mixed.params, mixed.grads, mixed.optimizer) == (2 * psi + psi, psi, 2 * psi)


@pytest.mark.parametrize("precision", ["mixed", "fp32"])
@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_fsdp2_zero2_follows_fully_shard(n: int, precision: str) -> None:
    # fp32 parameter shards, gradient shards and Adam's moments: 16 / N between steps; the
    # units' parameters gathered in fp32 ("32-true", and "bf16-mixed", whose autocast keeps
    # fp32 parameters) alive from forward to backward: 4 + 16 / N
    psi = 1_000_000
    plan = plan_memory(psi, n, precision=precision, device="cpu")
    fsdp2 = plan.per_device("fsdp2_zero2")
    assert (fsdp2.params, fsdp2.grads, fsdp2.optimizer) == (
        4 * psi + math.ceil(4 * psi / n),
        math.ceil(4 * psi / n),
        math.ceil(8 * psi / n),
    )
    assert fsdp2.compute_only == 4 * psi
    assert fsdp2.compute_peak == pytest.approx((4 + 16 / n) * psi, abs=3)
    assert fsdp2.step_peak == pytest.approx(16 / n * psi, abs=3)
    frozen = plan_memory(psi, n, trainable_params=psi // 4).per_device("fsdp2_zero2")
    assert frozen.grads == math.ceil(psi // 4 * 4 / n)  # frozen weights: no gradient
    assert frozen.optimizer == math.ceil(psi // 4 * 8 / n)


@pytest.mark.parametrize("static_graph", [False, True])
def test_ddp_buckets_follow_gradient_as_bucket_view(static_graph: bool) -> None:
    """Lightning's default keeps DDP's buckets beside the gradients (4 bytes per trainable
    parameter, in forward/backward and in the step); the kit's DDP strategies make the
    gradients views of them. A static graph changes no byte."""
    psi, trainable = 1_000_000, 600_000
    lightning = plan_memory(psi, 4, trainable_params=trainable, static_graph=static_graph)
    kit = plan_memory(psi, 4, trainable_params=trainable, gradient_as_bucket_view=True,
                      static_graph=static_graph)  # fmt: skip
    assert (lightning.gradient_as_bucket_view, kit.gradient_as_bucket_view) == (False, True)
    assert lightning.static_graph is kit.static_graph is static_graph
    before, after = lightning.per_device("ddp"), kit.per_device("ddp")
    assert before.model_states == after.model_states == 16 * trainable + 2 * (psi - trainable)
    assert (before.buckets, after.buckets) == (4 * trainable, 0)
    assert before.compute_peak - after.compute_peak == 4 * trainable
    assert before.step_peak - after.step_peak == 4 * trainable
    for name in lightning.names:  # nothing else moves
        if name != "ddp":
            assert lightning.per_device(name) == kit.per_device(name)
    assert "DDP's gradient buckets" in lightning.table()
    assert "DDP's gradient buckets" not in kit.table()


def test_activations_follow_korthikanti() -> None:
    s, b, h, a, layers = 2048, 4, 4096, 32, 24
    eager = activation_bytes(b, s, h, layers, a)
    assert eager == layers * s * b * h * (34 + 5 * a * s / h)
    assert activation_bytes(b, s, h, layers, a, fused_attention=True) == layers * 34 * s * b * h
    assert activation_bytes(b, s, h, layers, a, recompute=True) == layers * 2 * s * b * h
    plan = plan_memory(1e9, 8, batch_size=b, seq_len=s, hidden_size=h, n_layers=layers, n_heads=a)
    assert plan.per_device("zero2").activations == eager
    assert plan.per_device("zero2", checkpointing=True).activations == layers * 2 * s * b * h
    ddp = plan.per_device("ddp")
    # the peak is in backward: the activations and DDP's buckets beside the gradients
    assert ddp.total == ddp.compute_peak == ddp.model_states + eager + 4 * 1_000_000_000
    view = plan_memory(1e9, 8, batch_size=b, seq_len=s, hidden_size=h, n_layers=layers,
                       n_heads=a, gradient_as_bucket_view=True).per_device("ddp")  # fmt: skip
    assert view.total == view.compute_peak == ddp.model_states + eager


def test_total_counts_the_optimizer_steps_temporaries() -> None:
    # foreach Adam's sqrt(v): 4 bytes per parameter it updates, on that device's shard
    psi = 1_000_000
    adam = plan_memory(psi, 4)
    assert adam.per_device("ddp").transient == 4 * psi
    assert adam.per_device("zero2").transient == adam.per_device("fsdp_zero2").transient == psi
    assert adam.per_device("fsdp2_zero2").transient == psi
    assert adam.per_device("deepspeed_zero2").transient == psi
    assert adam.per_device("deepspeed_zero2_offload").transient == 0  # stepped on the host
    assert plan_memory(psi, 4, optimizer="sgd").per_device("ddp").transient == 0
    for name in adam.names:  # no activations asked for: the step is the peak...
        estimate = adam.per_device(name)
        # ...but for FSDP, whose unsharded weights outweigh the step's temporaries
        fsdp = name in ("fsdp_zero2", "fsdp2_zero2")
        peak = estimate.compute_peak if fsdp else estimate.step_peak
        assert estimate.total == peak > 0


def test_on_cpu_adam_steps_one_tensor_at_a_time() -> None:
    # single-tensor Adam: sqrt(v) / bias_correction, two temporaries of each tensor in
    # turn; large only for the one flat partition DeepSpeed hands the optimizer
    psi, n = 1_000_000, 4
    cpu = plan_memory(psi, n, device="cpu", precision="fp32")
    assert cpu.device == "cpu"
    assert cpu.per_device("ddp").transient == cpu.per_device("fsdp_zero2").transient == 0
    assert cpu.per_device("fsdp2_zero2").transient == 0
    assert cpu.per_device("deepspeed_zero2").transient == 8 * psi // n
    assert cpu.per_device("zero2").transient == 8 * psi // n
    cuda = plan_memory(psi, n, precision="fp32")
    for name in cpu.names:  # the model states do not depend on where the step runs
        assert cpu.per_device(name).model_states == cuda.per_device(name).model_states


def test_each_peak_counts_only_what_is_alive_then() -> None:
    # fp32, 2 devices, what torch's allocator recorded for the base VLM on two CPU
    # processes (benchmarks/memory.py): per parameter, in bytes
    psi, n = 1_000_000, 2
    shape = {"batch_size": 1, "seq_len": 8, "hidden_size": 64, "n_layers": 1}
    plan = plan_memory(psi, n, precision="fp32", device="cpu", **shape)
    acts = plan.activations
    assert acts is not None
    assert acts < psi
    # DeepSpeed: the weights (4), their fp32 partition clone (2), the moments (4), the
    # gradient partition reduced into (2): in backward; in the step also its flat fp32
    # copy (2) and single-tensor Adam's two temporaries (2 + 2)
    ds = plan.per_device("deepspeed_zero2")
    assert ds.compute_peak == 12 * psi + acts
    assert ds.step_peak == ds.total == 18 * psi
    # FSDP SHARD_GRAD_OP: the unsharded weights (4) exist only in forward and backward
    fsdp = plan.per_device("fsdp_zero2")
    assert fsdp.compute_peak == fsdp.total == 12 * psi + acts
    assert fsdp.step_peak == 8 * psi
    # DDP (Lightning's default): the buckets beside the gradients, in both phases; the
    # CPU step adds nothing
    ddp = plan.per_device("ddp")
    assert ddp.compute_peak == ddp.total == 20 * psi + acts
    assert ddp.step_peak == 20 * psi
    # the kit's DDP strategies: the gradients are the buckets
    kit = plan_memory(psi, n, precision="fp32", device="cpu", gradient_as_bucket_view=True,
                      **shape).per_device("ddp")  # fmt: skip
    assert (kit.compute_peak, kit.step_peak) == (16 * psi + acts, 16 * psi)
    # FSDP2, no reshard after forward: every unit gathered in fp32 when backward begins
    fsdp2 = plan.per_device("fsdp2_zero2")
    assert fsdp2.compute_peak == fsdp2.total == (4 + 16 // n) * psi + acts
    assert fsdp2.step_peak == 16 * psi // n


@given(
    psi=st.integers(1, 10**11), trainable=st.floats(0, 1), n=st.integers(1, 4096),
    precision=st.sampled_from(["mixed", "fp32"]), optimizer=st.sampled_from(["adam", "sgd"]),
    device=st.sampled_from(["cuda", "cpu"]), layers=st.integers(0, 64),
)  # fmt: skip
def test_more_devices_never_need_more_memory_per_device(
    psi: int, trainable: float, n: int, precision: str, optimizer: str, device: str, layers: int
) -> None:
    kwargs: dict[str, Any] = {"trainable_params": int(psi * trainable), "precision": precision,
                              "optimizer": optimizer, "device": device}  # fmt: skip
    if layers:
        kwargs.update(batch_size=2, seq_len=512, hidden_size=1024, n_layers=layers)
    fewer, more = plan_memory(psi, n, **kwargs), plan_memory(psi, n + 1, **kwargs)
    for name in PAPER + PRESETS:
        for ckpt in (False, True):
            assert more.per_device(name, ckpt).total <= fewer.per_device(name, ckpt).total
        # on CPU a flat partition's single-tensor Adam temporaries can outweigh DDP's
        assert fewer.per_device(name).total <= fewer.per_device("ddp").total or name in (
            "deepspeed_zero2", "fsdp_zero2", "fsdp2_zero2",  # the unsharded weights on top
        ) or device == "cpu"  # fmt: skip


def test_recommendation_is_the_fastest_that_fits() -> None:
    shape = {"batch_size": 1, "seq_len": 4096, "hidden_size": 4096, "n_layers": 32}
    plan = plan_memory(7e9, 8, **shape, fused_attention=True)
    assert plan.recommend(80 * GIB) == ("fsdp_zero2", False)  # DDP's 104 GiB do not fit
    assert plan.recommend(24 * GIB) == ("deepspeed_zero2_offload", True)
    assert plan.recommend(8 * GIB) is None
    small = plan_memory(1e8, 8)
    assert small.recommend(80 * GIB) == ("ddp", False)
    table = plan.table(80 * GIB)
    assert "fsdp_zero2" in table
    assert "host memory" in table


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((7e9, 0), {}, "n_devices"),
        ((0, 8), {}, "n_params"),
        ((7e9, 8), {"optimizer": "lion"}, "optimizer"),
        ((7e9, 8), {"precision": "fp8"}, "precision"),
        ((7e9, 8), {"trainable_params": 8e9}, "trainable_params"),
        ((7e9, 8), {"batch_size": 4, "seq_len": 2048}, "hidden_size"),
        ((7e9, 8), {"device": "gpu"}, "device"),
        ((7e9, 8), {"gradient_as_bucket_view": "yes"}, "gradient_as_bucket_view"),
        ((7e9, 8), {"static_graph": 1}, "static_graph"),
    ],
)
def test_bad_input(args: tuple[float, int], kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(SpeedkitConfigError, match=match):
        plan_memory(*args, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(SpeedkitConfigError, match="not a planned strategy"):
        plan_memory(1e6, 1).per_device("zero4")


def small_vlm_frozen_vision() -> Any:
    """A factory for ``--model``: the example VLM, vision tower frozen."""
    from speedkit_examples.vlm import VLM, VLMConfig

    model = VLM(VLMConfig.preset("small", 64))
    model.vision.requires_grad_(False)
    return model


def test_count_parameters_on_the_meta_device() -> None:
    real = small_vlm_frozen_vision()
    total, trainable = count_parameters(f"{__name__}:small_vlm_frozen_vision")
    assert total == sum(p.numel() for p in real.parameters())
    assert trainable == sum(p.numel() for p in real.parameters() if p.requires_grad) < total
    for bad, match in [("speedkit_examples.vlm", "MODULE:FACTORY"),
                       ("no_such_module_xyz:make", "cannot import"),
                       ("speedkit_examples.vlm:nothing", "no callable")]:  # fmt: skip
        with pytest.raises(SpeedkitConfigError, match=match):
            count_parameters(bad)


def test_heads_that_do_not_divide_the_hidden_size_are_refused() -> None:
    with pytest.raises(SpeedkitConfigError, match=r"`n_heads` must divide `hidden_size=2048`"):
        plan_memory(1e9, 2, batch_size=1, seq_len=128, hidden_size=2048, n_layers=2, n_heads=7)
