from __future__ import annotations

import pytest
import torch

from lightning_speedkit import peak_flops
from lightning_speedkit.measure import peak
from lightning_speedkit.measure.peak import PEAK_TABLE, measure_matmul_peak, resolve_device_name

# Names exactly as torch.cuda.get_device_name() prints them on real machines.
REAL_NAMES = [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.5e12),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5e12),
    ("NVIDIA H200", "H200 SXM", 989.4e12),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5e12),
    ("NVIDIA GH200 480GB", "GH200", 989.4e12),
    ("NVIDIA B200", "B200", 2250e12),
    ("NVIDIA A100-SXM4-80GB", "A100", 312e12),
    ("NVIDIA A100-PCIE-40GB", "A100", 312e12),
    ("NVIDIA A100 80GB PCIe", "A100", 312e12),
    ("NVIDIA L4", "L4", 121e12),
    ("NVIDIA L40S", "L40S", 362.05e12),
    ("NVIDIA A10", "A10", 125e12),
    ("NVIDIA A10G", "A10G", 125e12),
    ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2e12),
    ("NVIDIA RTX A6000", "RTX A6000", 154.8e12),
    ("AMD Instinct MI300X", "MI300X", 1307.4e12),
]


@pytest.mark.parametrize(("name", "key", "bf16"), REAL_NAMES)
def test_real_device_names_resolve(name: str, key: str, bf16: float) -> None:
    assert resolve_device_name(name) == key
    assert peak_flops(name, torch.bfloat16) == pytest.approx(bf16)


@pytest.mark.parametrize(
    ("name", "key"),
    [("Tesla V100-SXM2-16GB", "V100 SXM2"), ("Tesla V100-PCIE-32GB", "V100 PCIe")],
)
def test_v100_has_fp16_but_no_bf16(name: str, key: str) -> None:
    assert resolve_device_name(name) == key
    assert peak_flops(name, torch.float16) is not None
    assert peak_flops(name, torch.bfloat16) is None  # no bf16 tensor cores: unknown, never 0


def test_every_row_is_sourced_and_dense() -> None:
    for key, row in PEAK_TABLE.items():
        assert row.source, key
        assert all(v > 0 for v in row.flops.values()), key
    # Dense figures: half the datasheet's "with sparsity" 1,979 TFLOPS for H100 SXM bf16.
    assert PEAK_TABLE["H100 SXM"].flops[torch.bfloat16] == pytest.approx(1978.9e12 / 2, rel=1e-3)


def test_fp32_means_tf32_unless_precision_is_highest() -> None:
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert peak_flops("NVIDIA H100 80GB HBM3", torch.float32) == pytest.approx(67e12)
        torch.set_float32_matmul_precision("high")
        assert peak_flops("NVIDIA H100 80GB HBM3", torch.float32) == pytest.approx(494.7e12)
    finally:
        torch.set_float32_matmul_precision(before)


def test_overrides_win_by_name_or_key() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16", overrides={"H100 SXM": 7e14}) == 7e14
    assert peak_flops("Custom ASIC", "bf16", overrides={"Custom ASIC": 1e15}) == 1e15


def test_unknown_device_is_none_and_cpu_is_measured() -> None:
    assert peak_flops("Custom ASIC", "bf16") is None
    assert peak_flops(torch.device("cpu"), torch.float32) is None
    measured = peak_flops(torch.device("cpu"), torch.float32, measure=True)
    assert measured is not None
    assert 1e8 < measured < 1e14


def test_what_a_matmul_cannot_measure_stays_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    """A meta device computes nothing (it timed at 2.7e14); FP8 is no plain torch.mm (it
    returned the fp32 rate under FP8's name); int8 raised torch's own error."""
    timed: list[torch.dtype] = []
    monkeypatch.setattr(peak, "measure_matmul_peak",
                        lambda device, dtype: timed.append(dtype) or 1e9)  # fmt: skip
    assert peak_flops(torch.device("meta"), torch.float32, measure=True) is None
    assert peak_flops(torch.device("cpu"), "fp8", measure=True) is None
    assert peak_flops(torch.device("cpu"), torch.int8, measure=True) is None
    assert timed == []
    assert peak_flops(torch.device("cpu"), "tf32", measure=True) == 1e9  # a float32 matmul
    assert peak_flops(torch.device("cpu"), torch.float16, measure=True) == 1e9
    assert timed == [torch.float32, torch.float16]


def test_measured_peak_is_a_real_matmul_rate() -> None:
    rate = measure_matmul_peak("cpu", torch.float32, size=256, seconds=0.05)
    assert 1e8 < rate < 1e14


def test_unknown_dtype_name_is_refused() -> None:
    with pytest.raises(ValueError, match="dtype"):
        peak_flops("NVIDIA H100 80GB HBM3", "int3")
