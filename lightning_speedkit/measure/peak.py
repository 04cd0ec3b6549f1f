"""Dense peak FLOP/s per device and dtype: one sourced table, overrides, and a measured fallback.

Every figure is the vendor's **dense** peak (datasheets print tensor-core figures
"with sparsity", which are twice the dense ones; those are halved here). MFU is
only comparable across papers when the denominator is the dense peak.

``peak_flops(device, dtype)`` resolves names the way ``torch.cuda.get_device_name()``
prints them ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB",
"Tesla V100-SXM2-16GB", "AMD Instinct MI300X"), so the lookup works on real
machines rather than on the marketing name.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lightning_speedkit import _validation

__all__ = ["PEAK_TABLE", "DevicePeak", "measure_matmul_peak", "peak_flops", "resolve_device_name"]

# Keys used for dtypes in the table.
_TF32 = "tf32"
_FP8 = "fp8"
T = 1e12


@dataclass(frozen=True)
class DevicePeak:
    """Dense peak FLOP/s of one device, by dtype, and where the figures come from."""

    name: str
    flops: dict[object, float]
    source: str


def _row(name: str, source: str, **by_dtype: float) -> DevicePeak:
    keys = {
        "fp64": torch.float64,
        "fp32": torch.float32,
        "tf32": _TF32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp8": _FP8,
    }
    return DevicePeak(name, {keys[k]: v * T for k, v in by_dtype.items()}, source)


_H100_DS = (
    "NVIDIA H100 Tensor Core GPU datasheet (2023); tensor figures halved from 'with sparsity'"
)
_H200_DS = (
    "NVIDIA H200 Tensor Core GPU datasheet (2024); tensor figures halved from 'with sparsity'"
)

#: The table, keyed by canonical device name. Figures in FLOP/s, dense.
PEAK_TABLE: dict[str, DevicePeak] = {
    row.name: row
    for row in (
        _row(
            "B200",
            "NVIDIA HGX B200 datasheet (2024), per GPU; tensor figures halved from 'with sparsity'",
            tf32=1100,
            bf16=2250,
            fp16=2250,
            fp8=4500,
        ),
        _row(
            "H200 SXM", _H200_DS, fp64=34, fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9
        ),
        _row(
            "H200 NVL", _H200_DS, fp64=30, fp32=60, tf32=417.5, bf16=835.5, fp16=835.5, fp8=1670.5
        ),
        _row(
            "H100 SXM", _H100_DS, fp64=34, fp32=67, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9
        ),
        _row("H100 PCIe", _H100_DS, fp64=26, fp32=51, tf32=378, bf16=756.5, fp16=756.5, fp8=1513),
        _row(
            "H100 NVL", _H100_DS, fp64=30, fp32=60, tf32=417.5, bf16=835.5, fp16=835.5, fp8=1670.5
        ),
        _row(
            "GH200",
            "NVIDIA GH200 Grace Hopper Superchip datasheet (2023), GPU only; tensor "
            "figures halved from 'with sparsity'",
            fp64=34,
            fp32=67,
            tf32=494.7,
            bf16=989.4,
            fp16=989.4,
            fp8=1978.9,
        ),
        _row(
            "A100",
            "NVIDIA A100 Tensor Core GPU datasheet (2021); SXM and PCIe, 40 and 80 GB alike",
            fp64=9.7,
            fp32=19.5,
            tf32=156,
            bf16=312,
            fp16=312,
        ),
        _row(
            "L40S",
            "NVIDIA L40S datasheet (2023); tensor figures halved from 'with sparsity'",
            fp32=91.6,
            tf32=183,
            bf16=362.05,
            fp16=362.05,
            fp8=733,
        ),
        _row(
            "L4",
            "NVIDIA L4 datasheet (2023); tensor figures halved from 'with sparsity'",
            fp32=30.3,
            tf32=60,
            bf16=121,
            fp16=121,
            fp8=242.5,
        ),
        _row(
            "A10G",
            "No NVIDIA datasheet; AWS documents the A10G as an A10 variant, so the A10 "
            "datasheet's figures are used",
            fp32=31.2,
            tf32=62.5,
            bf16=125,
            fp16=125,
        ),
        _row(
            "A10",
            "NVIDIA A10 datasheet (2021); dense tensor figures",
            fp32=31.2,
            tf32=62.5,
            bf16=125,
            fp16=125,
        ),
        _row(
            "RTX 4090",
            "NVIDIA Ada Lovelace architecture whitepaper v2.1, table 2 (FP16/BF16 "
            "tensor with FP32 accumulate, dense)",
            fp32=82.6,
            tf32=82.6,
            bf16=165.2,
            fp16=165.2,
            fp8=330.3,
        ),
        _row(
            "RTX A6000",
            "NVIDIA RTX A6000 datasheet (2021): 309.7 TFLOPS tensor with sparsity, halved",
            fp32=38.7,
            tf32=77.4,
            bf16=154.8,
            fp16=154.8,
        ),
        _row(
            "V100 SXM2",
            "NVIDIA V100 Tensor Core GPU datasheet (2020)",
            fp64=7.8,
            fp32=15.7,
            fp16=125,
        ),
        _row(
            "V100 PCIe", "NVIDIA V100 Tensor Core GPU datasheet (2020)", fp64=7, fp32=14, fp16=112
        ),
        _row(
            "MI300X",
            "AMD Instinct MI300X datasheet (2023); dense matrix figures",
            fp64=163.4,
            fp32=163.4,
            tf32=653.7,
            bf16=1307.4,
            fp16=1307.4,
            fp8=2614.9,
        ),
        _row(
            "MI250X",
            "AMD Instinct MI250X datasheet (2021); matrix figures",
            fp64=95.7,
            fp32=95.7,
            bf16=383,
            fp16=383,
        ),
    )
}

# Ordered rules from a device-name string to a table key: the more specific first
# ("H100 NVL" before "H100", "A100" and "A10G" before "A10", "L40S" before "L4").
_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(p, re.I), key)
    for p, key in (
        (r"\bB200\b", "B200"),
        (r"\bGH200\b", "GH200"),
        (r"\bH200\b.*\bNVL\b", "H200 NVL"),
        (r"\bH200\b", "H200 SXM"),
        (r"\bH100\b.*\bNVL\b", "H100 NVL"),
        (r"\bH100\b.*\bPCIe\b", "H100 PCIe"),
        (r"\bH100\b", "H100 SXM"),
        (r"\bA100\b", "A100"),
        (r"\bL40S\b", "L40S"),
        (r"\bL4\b", "L4"),
        (r"\bA10G\b", "A10G"),
        (r"\bA10\b", "A10"),
        (r"\bRTX 4090\b", "RTX 4090"),
        (r"\bRTX A6000\b", "RTX A6000"),
        (r"\bV100\b.*\bPCIE\b", "V100 PCIe"),
        (r"\bV100\b", "V100 SXM2"),
        (r"\bMI300X\b", "MI300X"),
        (r"\bMI250X?\b", "MI250X"),
    )
]


def resolve_device_name(name: str) -> str | None:
    """The table key for a device name as the driver prints it, or None when unknown.

    Example::

        >>> resolve_device_name("NVIDIA H100 80GB HBM3"), resolve_device_name("NVIDIA H200")
        ('H100 SXM', 'H200 SXM')
    """
    for pattern, key in _RULES:
        if pattern.search(name):
            return key
    return None


def _dtype_key(dtype: torch.dtype | str) -> object:
    if isinstance(dtype, str):
        aliases: dict[str, object] = {
            "fp64": torch.float64, "float64": torch.float64,
            "fp32": torch.float32, "float32": torch.float32,
            "tf32": _TF32, "tfloat32": _TF32,
            "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
            "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
            "fp8": _FP8,
        }  # fmt: skip
        if dtype.lower() not in aliases:
            _validation.choice("dtype", dtype, sorted(aliases), hint="or a torch dtype")
        return aliases[dtype.lower()]
    if not isinstance(dtype, torch.dtype):
        _validation.fail("dtype", dtype, "must be a torch dtype or its name",
                         "pass e.g. `dtype=torch.bfloat16` or `dtype='bf16'`")  # fmt: skip
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return _FP8
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return _TF32  # fp32 matmuls run on TF32 tensor cores at this precision setting
    return dtype


def measure_matmul_peak(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    size: int = 1024,
    seconds: float = 0.3,
) -> float:
    """Best FLOP/s of a square matmul on ``device``: the only sensible peak on a CPU.

    Repeats an ``size`` x ``size`` matmul for about ``seconds`` after one warm-up
    and returns the best rate seen. It runs at whatever thread count torch uses,
    so it is the peak of this process as configured.
    """
    device = torch.device(device)
    # Its own generator: a seeded run draws its loader's shuffle seed from the global one,
    # and SpeedMonitor measures before the first epoch.
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # SYNC: timing a benchmark, not a training step

    torch.mm(a, b)
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def peak_flops(
    device: torch.device | str,
    dtype: torch.dtype | str = torch.bfloat16,
    *,
    overrides: dict[str, float] | None = None,
    measure: bool = False,
) -> float | None:
    """Dense peak FLOP/s of ``device`` at ``dtype``, or None when unknown.

    Args:
        device: a ``torch.device`` (CUDA devices are looked up by their name) or a
            device name as ``torch.cuda.get_device_name()`` prints it.
        dtype: the compute dtype. ``torch.float32`` means TF32 when
            ``torch.get_float32_matmul_precision()`` is not ``"highest"``.
        overrides: ``{device name or table key: FLOP/s}``, checked first: for a
            device the table lacks, or a clock-limited part.
        measure: when the table has no figure (a CPU, an unknown part), time a
            matmul on ``device`` and return that (needs a real ``torch.device``, and a
            floating dtype other than FP8: for the others the peak stays unknown).

    Example::

        >>> peak_flops("NVIDIA H200", torch.bfloat16)
        989400000000000.0
        >>> peak_flops("NVIDIA A100-SXM4-80GB", "fp32")
        19500000000000.0
        >>> peak_flops("Mystery Accelerator 9000") is None
        True
    """
    fix = "pass e.g. `torch.device('cuda', 0)` or 'NVIDIA H100 80GB HBM3'"
    _validation.instance(
        "device", device, (torch.device, str), what="a device or its name", fix=fix
    )
    if overrides is not None:
        fix = "pass e.g. `overrides={'NVIDIA H100 80GB HBM3': 700e12}`"
        _validation.instance("overrides", overrides, Mapping, what="a dict of FLOP/s", fix=fix)
    for name, figure in (overrides or {}).items():
        _validation.text("overrides", name, example="NVIDIA H100 80GB HBM3")
        _validation.positive_number(f"overrides[{name!r}]", figure, example=989.4e12,
                                    hint="dense FLOP/s of one device")  # fmt: skip
    _validation.boolean("measure", measure)
    torch_device: torch.device | None = None
    if isinstance(device, torch.device):
        torch_device = device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    else:
        name = device
    key = resolve_device_name(name)
    dtype_key = _dtype_key(dtype)
    for candidate in (name, key):
        if overrides and candidate in overrides:
            return float(overrides[candidate])
    if key is not None and dtype_key in PEAK_TABLE[key].flops:
        return PEAK_TABLE[key].flops[dtype_key]
    if measure and torch_device is not None and torch_device.type != "meta":
        # TF32 is a float32 matmul at this precision setting; a matmul of FP8 or of an
        # integer dtype is no plain torch.mm, and a meta device computes nothing: unknown.
        real = torch.float32 if dtype_key is _TF32 else dtype_key
        if isinstance(real, torch.dtype) and real.is_floating_point:
            return measure_matmul_peak(torch_device, real)
    return None
