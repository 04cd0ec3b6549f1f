"""Whether torch's fused or foreach kernel runs a parameter group as the plain step does.

Throwaway weights, one per device and dtype of the group, take a few steps with the
flag and the same steps with the plain (single-tensor) implementation; their weights
and state must agree within the dtype's rounding. A combination torch refuses, or one
it computes wrongly, is found here rather than in training.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

import torch

__all__ = ["Implementation", "devices_and_dtypes", "probe"]

Implementation = Literal["fused", "foreach"]
# The probe: big enough that every element-wise kernel runs its vectorised loop (CPU
# vectors hold 8 to 64 elements) and a scalar tail (the size is prime), a few steps so
# that state created at the first step (momentum buffers) is read and updated after.
_PROBE_NUMEL = 1031
_PROBE_STEPS = 3
_PROBE_LR = 0.1  # moves a probe weight of about 1 by many units of bf16 rounding per step


def devices_and_dtypes(group: dict[str, Any]) -> list[tuple[torch.device, torch.dtype]]:
    return list(dict.fromkeys((p.device, p.dtype) for p in group["params"]))


def _tolerance(dtype: torch.dtype) -> float:
    """How far apart (relative, in norm) two correct implementations may land after the probe.

    Rounding differs in low precision: 16 units of rounding (0.125 in bfloat16, 0.016 in
    float16; fused and plain Adam measure 0.03 and 0.004 apart), never below 1e-4.
    """
    eps = torch.finfo(dtype).eps if dtype.is_floating_point or dtype.is_complex else 0.0
    return max(16 * eps, 1e-4)


def _probe_values(count: int, generator: torch.Generator) -> torch.Tensor:
    """Magnitudes in [0.5, 1.5) with random signs: no rounding to zero, no overflow in fp16."""
    sign = torch.randint(0, 2, (count,), generator=generator) * 2 - 1
    return (torch.rand(count, generator=generator) + 0.5) * sign


def _run_probe(
    cls: type[torch.optim.Optimizer],
    options: dict[str, Any],
    places: list[tuple[torch.device, torch.dtype]],
) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
    """Per probe weight: before and after ``_PROBE_STEPS`` steps, and its state (same data)."""
    generator = torch.Generator().manual_seed(0)
    starts = [_probe_values(_PROBE_NUMEL, generator).to(device=d, dtype=t) for d, t in places]
    grads = [[_probe_values(_PROBE_NUMEL, generator).to(device=d, dtype=t) for d, t in places]
             for _ in range(_PROBE_STEPS)]  # fmt: skip
    params = [start.clone().requires_grad_() for start in starts]
    optimizer = cls(params, **options)
    for step_grads in grads:
        for param, grad in zip(params, step_grads, strict=True):
            param.grad = grad.clone()
        optimizer.step()
    return [(s, p.detach(), dict(optimizer.state[p])) for s, p in zip(starts, params, strict=True)]


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """On the CPU in float32 (complex64 for complex), to compare across devices and dtypes."""
    return tensor.detach().cpu().to(torch.complex64 if tensor.is_complex() else torch.float32)


def _distance(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> float:
    """``||got - want|| / scale``; NaN where either holds a NaN."""
    return float((_wide(got) - _wide(want)).norm() / scale.clamp_min(1e-12))


def _disagreement(
    plain: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]],
    tried: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]],
) -> str | None:
    """Where the tried implementation's probe parted from the plain one's; None if nowhere."""
    for (start, want, want_state), (_, got, got_state) in zip(plain, tried, strict=True):
        tolerance = _tolerance(start.dtype)
        where = f"on {start.device.type} {str(start.dtype).removeprefix('torch.')} parameters"
        update = (_wide(want) - _wide(start)).norm()
        off = _distance(got, want, update)
        if not off <= tolerance:  # NaN counts as off
            moved = _distance(got, start, update)
            if moved < 0.5:
                return f"{where} (it moves the weights {moved:.0%} as far as the plain step)"
            return f"{where} (its weights land {off:.0%} of the update away from the plain step's)"
        for key, expected in want_state.items():
            found = got_state.get(key)
            if not isinstance(expected, torch.Tensor) or not isinstance(found, torch.Tensor):
                if (
                    isinstance(expected, torch.Tensor)
                    or isinstance(found, torch.Tensor)
                    or (found != expected)
                ):
                    return (
                        f"{where} (its state `{key}` is {found!r}, the plain step's {expected!r})"
                    )
                continue
            if found.shape != expected.shape:
                return f"{where} (its state `{key}` has another shape than the plain step's)"
            off = _distance(found, expected, _wide(expected).norm())
            if not off <= tolerance:
                return f"{where} (its state `{key}` lands {off:.0%} away from the plain step's)"
    return None


def probe(
    cls: type[torch.optim.Optimizer], group: dict[str, Any], flag: Implementation
) -> str | None:
    """Why ``flag=True`` cannot run ``group`` as the plain optimizer does; None if it can.

    Throwaway weights, one per device and dtype of the group's parameters, take the same
    steps with the flag and with the plain single-tensor implementation, with the
    group's hyperparameters (but a learning rate that moves them well past rounding):
    the flag's weights and state must land where the plain ones do. The reason reads
    after "torch's fused Adam".
    """
    places = devices_and_dtypes(group)
    if not places:
        return None
    accepted = inspect.signature(cls.__init__).parameters
    options = {k: v for k, v in group.items() if k in accepted and k not in ("params", "foreach",
                                                                            "fused")}  # fmt: skip
    if "lr" in options:
        lr = options["lr"]
        options["lr"] = (
            torch.full_like(lr, _PROBE_LR) if isinstance(lr, torch.Tensor) else _PROBE_LR
        )
    reference = dict(options, foreach=False) if "foreach" in accepted else dict(options)
    try:
        plain = _run_probe(cls, reference, places)
    except Exception as exc:  # the plain step cannot run these options on these devices either
        return f"could not be checked: the plain step fails on a probe too ({_error(exc)})"
    try:
        tried = _run_probe(cls, dict(options, **{flag: True}), places)
    except Exception as exc:  # torch refuses unsupported combinations with several error types
        return f"refused these parameters ({_error(exc)})"
    why = _disagreement(plain, tried)
    return None if why is None else f"does not match the plain step {why}"


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
