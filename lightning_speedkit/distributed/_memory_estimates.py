"""Bytes per device of each data-parallel strategy: the ZeRO paper's stages and the presets.

The accounting :func:`~lightning_speedkit.distributed.plan_memory.plan_memory` documents,
one function per family of strategies: the paper's stages (and DDP's buckets), DeepSpeed's
ZeRO-2 with and without offload, FSDP's and FSDP2's ZeRO-2. Each takes the parameter
counts and the bytes per parameter (:class:`ParamBytes`), nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["OPTIMIZERS", "PAPER", "PRESETS", "MemoryEstimate", "ParamBytes", "estimate_strategies"]

#: The ZeRO paper's stages (Rajbhandari et al. 2020, Figure 1), then what the presets
#: really allocate.
PAPER = ("ddp", "zero1", "zero2", "zero3")
PRESETS = ("fsdp_zero2", "fsdp2_zero2", "deepspeed_zero2", "deepspeed_zero2_offload")
_STATES = {"adam": 2, "adamw": 2, "sgd": 1}  # fp32 tensors per parameter (SGD: momentum)
#: The optimizers the plan knows.
OPTIMIZERS = tuple(_STATES)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device holds; ``host`` is the host memory offload needs (DeepSpeed's estimate).

    A training step has two peaks that never meet: forward and backward, while the
    activations are alive, and the optimizer step, after they are freed. Some model
    states live in only one of them (``step_only``, ``compute_only``), and each has
    its own temporaries (``transient`` in the step, ``compute_transient`` with the
    activations). ``total`` is the higher of the two.
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    host: int = 0
    transient: int = 0
    """Temporaries of the optimizer step (foreach Adam's ``sqrt(exp_avg_sq)``)."""
    compute_transient: int = 0
    """Temporaries alive with the activations (DDP's gradient buckets, rebuilt at the
    second step while the first ones are still referenced)."""
    step_only: int = 0
    """Model states that exist only during the optimizer step (the fp32 copy of the
    gradient partition DeepSpeed's step makes)."""
    compute_only: int = 0
    """Model states that exist only from forward to the end of backward (the unsharded
    weights FSDP's ``SHARD_GRAD_OP`` and FSDP2's ``reshard_after_forward=False`` keep)."""
    buckets: int = 0
    """DDP's gradient buckets beside the gradients (``gradient_as_bucket_view=False``):
    a second copy of them, alive in both phases."""

    @property
    def model_states(self) -> int:
        """Parameters, gradients and optimizer state: what ZeRO partitions."""
        return self.params + self.grads + self.optimizer

    @property
    def compute_peak(self) -> int:
        """Forward and backward: model states, activations, their temporaries."""
        return (self.model_states - self.step_only + self.activations + self.compute_transient
                + self.buckets)  # fmt: skip

    @property
    def step_peak(self) -> int:
        """The optimizer step: model states and the step's temporaries."""
        return self.model_states - self.compute_only + self.transient + self.buckets

    @property
    def total(self) -> int:
        """The peak: the higher of :attr:`compute_peak` and :attr:`step_peak`."""
        return max(self.compute_peak, self.step_peak)


@dataclass(frozen=True)
class ParamBytes:
    """What one parameter costs, in bytes, for a precision, an optimizer and a device.

    Example::

        >>> ParamBytes.of("adam", "mixed", "cuda")  # the paper's 2 + 2 + K = 12
        ParamBytes(weight=2, master=4, moments=8, step_temp=4, flat_step_temp=4, mixed=True)
        >>> ParamBytes.of("adamw", "fp32", "cpu").flat_step_temp  # single-tensor Adam
        8
    """

    weight: int
    """The weights (and gradients) compute uses: 2 in mixed precision, 4 in fp32."""
    master: int
    """The fp32 copy of the trainable weights mixed precision keeps (0 in fp32)."""
    moments: int
    """The fp32 optimizer state."""
    step_temp: int
    """The optimizer step's temporaries per parameter it updates, tensor by tensor."""
    flat_step_temp: int
    """The same on a flat partition (DeepSpeed, the ``zero*`` rows)."""
    mixed: bool

    @classmethod
    def of(cls, optimizer: str, precision: str, device: str) -> ParamBytes:
        """The bytes of ``optimizer`` (``adam``, ``adamw``, ``sgd``) in ``precision``
        (``mixed``, ``fp32``), its step run on ``device`` (``cuda``, ``cpu``)."""
        states = _STATES[optimizer]
        mixed = precision == "mixed"
        # The optimizer step's temporaries, per parameter it updates. Foreach Adam/AdamW
        # (accelerators) allocates sqrt(exp_avg_sq) for the whole group at once; the
        # single-tensor path (CPU) sqrt(v) / bias_correction, two temporaries of one tensor
        # at a time: only a flat partition (DeepSpeed, the zero* rows) makes that large.
        foreach = device != "cpu"
        return cls(
            weight=2 if mixed else 4,
            master=4 if mixed else 0,
            moments=4 * states,
            step_temp=(4 if foreach else 0) if states == 2 else 0,
            flat_step_temp=(4 if foreach else 8) if states == 2 else 0,
            mixed=mixed,
        )


def estimate_strategies(
    total: int, trainable: int, n: int, size: ParamBytes, bucket_view: bool
) -> dict[str, MemoryEstimate]:
    """Every strategy's estimate without activations, the paper's stages first.

    Example::

        >>> rows = estimate_strategies(1000, 1000, 4, ParamBytes.of("adam", "mixed", "cuda"),
        ...                            bucket_view=True)
        >>> " ".join(rows)
        'ddp zero1 zero2 zero3 deepspeed_zero2 deepspeed_zero2_offload fsdp_zero2 fsdp2_zero2'
        >>> rows["zero3"].model_states  # 16 bytes per parameter over 4 devices
        4000
    """
    return {
        **paper_stages(total, trainable, n, size, bucket_view),
        **deepspeed_zero2(total, trainable, n, size),
        **fsdp_zero2(total, trainable, n, size),
    }


def paper_stages(
    total: int, trainable: int, n: int, size: ParamBytes, bucket_view: bool
) -> dict[str, MemoryEstimate]:
    """DDP and ZeRO-1/2/3 as the paper counts them; DDP's buckets unless the gradients
    are views into them."""

    def stage(level: int) -> MemoryEstimate:
        k = size.master + size.moments  # the paper's K (12 for mixed-precision Adam)
        step = (_div(size.flat_step_temp * trainable, n) if level >= 1
                else size.step_temp * trainable)  # fmt: skip
        return MemoryEstimate(
            params=_div(size.weight * total, n) if level >= 3 else size.weight * total,
            grads=_div(size.weight * trainable, n) if level >= 2 else size.weight * trainable,
            optimizer=_div(k * trainable, n) if level >= 1 else k * trainable,
            activations=0,
            transient=step,
        )

    estimates = {name: stage(level) for level, name in enumerate(PAPER)}
    # DDP's buckets: fp32 in either precision (torch autocast, Lightning's "*-mixed", keeps
    # fp32 weights and gradients, the same 16 bytes as the paper's split of 2 + 2 + 12).
    # Beside the gradients for good, unless the gradients are views into them; then the
    # kit's strategies free the first buckets before DDP lays out the second ones. The
    # static graph moves that rebuild one iteration later and changes no byte.
    if not bucket_view:
        estimates["ddp"] = replace(estimates["ddp"], buckets=4 * trainable)
    return estimates


def deepspeed_zero2(
    total: int, trainable: int, n: int, size: ParamBytes
) -> dict[str, MemoryEstimate]:
    """DeepSpeed's ZeRO-2, on the device and with the optimizer offloaded to the host."""
    # DeepSpeed ZeRO-2 keeps a 16-bit and an fp32 gradient partition in mixed precision,
    # and an fp32 copy of its weight partition in any precision (a clone even in fp32).
    # In fp32 its step still flattens the reduced partition into a new tensor beside it
    # (the cast to fp32 that makes the second partition in mixed precision is then a
    # no-op, the flattening is not): two fp32 gradient partitions. The fp32 one exists
    # only in the step.
    on_device = MemoryEstimate(
        params=size.weight * total + _div(4 * trainable, n),
        grads=_div((2 + 4 if size.mixed else 4 + 4) * trainable, n),
        optimizer=_div(size.moments * trainable, n),
        activations=0,
        transient=_div(size.flat_step_temp * trainable, n),
        step_only=_div(4 * trainable, n),
    )
    offload = MemoryEstimate(
        params=size.weight * total,
        grads=0,
        optimizer=0,
        activations=0,
        host=int(trainable * max(4 * n, 16) * 1.5),  # DeepSpeed's estimate, buffers included
    )
    return {"deepspeed_zero2": on_device, "deepspeed_zero2_offload": offload}


def fsdp_zero2(total: int, trainable: int, n: int, size: ParamBytes) -> dict[str, MemoryEstimate]:
    """FSDP's ``SHARD_GRAD_OP`` and FSDP2's ``reshard_after_forward=False``."""
    # FSDP's sharded flat parameter is fp32; SHARD_GRAD_OP keeps the unsharded compute copy
    # from forward to the end of backward. (One fp32 rank needs no separate copy; counted
    # anyway, so that the plan never grows with the device count.)
    fsdp = MemoryEstimate(
        params=size.weight * total + _div(4 * total, n),
        grads=_div(4 * trainable, n),
        optimizer=_div(size.moments * trainable, n),
        activations=0,
        transient=_div(size.step_temp * trainable, n),
        compute_only=size.weight * total,
    )
    # FSDP2 keeps fp32 parameter shards (DTensors), gradient shards and moments: 16 / N
    # between steps. With reshard_after_forward=False each unit's parameters, gathered in
    # fp32 under the Trainer's "32-true" and "bf16-mixed" (autocast casts per operation),
    # stay whole from its forward to the end of its backward: all of them at once when
    # backward begins, 4 + 16 / N. (Its MixedPrecisionPolicy with bf16 parameters gathers
    # 2 bytes instead; one unit's unsharded gradient lives briefly before its
    # reduce-scatter, as the unit frees its parameters.)
    fsdp2 = MemoryEstimate(
        params=_div(4 * total, n) + 4 * total,
        grads=_div(4 * trainable, n),
        optimizer=_div(size.moments * trainable, n),
        activations=0,
        transient=_div(size.step_temp * trainable, n),
        compute_only=4 * total,
    )
    return {"fsdp_zero2": fsdp, "fsdp2_zero2": fsdp2}


def _div(value: int, n: int) -> int:
    return math.ceil(value / n)
