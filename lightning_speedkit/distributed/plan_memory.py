"""plan_memory: per-device memory of each data-parallel strategy, before you run out of it."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from lightning_speedkit import _validation
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["MemoryEstimate", "MemoryPlan", "count_parameters", "plan_memory"]

OptimizerName = Literal["adam", "adamw", "sgd"]
PrecisionName = Literal["mixed", "fp32"]
DeviceName = Literal["cuda", "cpu"]
_STATES = {"adam": 2, "adamw": 2, "sgd": 1}  # fp32 tensors per parameter (SGD: momentum)
_PRECISIONS = ("mixed", "fp32")
_DEVICES = ("cuda", "cpu")
_GIB = 2**30

#: The ZeRO paper's stages (Rajbhandari et al. 2020, Figure 1), then what the presets
#: really allocate. The order is also the order of preference when several fit:
#: less communication and no offload first.
PAPER = ("ddp", "zero1", "zero2", "zero3")
PRESETS = ("fsdp_zero2", "fsdp2_zero2", "deepspeed_zero2", "deepspeed_zero2_offload")
_PREFERENCE = ("ddp", "fsdp_zero2", "fsdp2_zero2", "deepspeed_zero2", "zero1",
               "deepspeed_zero2_offload", "zero3")  # fmt: skip


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
class MemoryPlan:
    """Per-device estimates for each strategy; see :func:`plan_memory`."""

    n_params: int
    trainable_params: int
    n_devices: int
    optimizer: str
    precision: str
    activations: int | None
    """Activation bytes per device without recomputation (None: not asked for)."""
    activations_checkpointed: int | None
    """The same with every transformer layer recomputed (only its input kept)."""
    estimates: dict[str, MemoryEstimate] = field(repr=False)
    device: str = "cuda"
    """Where the optimizer steps (``"cuda"``: any accelerator; ``"cpu"``)."""
    gradient_as_bucket_view: bool = False
    """DDP's gradients as views into its buckets (the kit's DDP strategies) or beside them."""
    static_graph: bool = False
    """DDP's ``static_graph`` (the same bytes either way)."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.estimates)

    def per_device(self, name: str, checkpointing: bool = False) -> MemoryEstimate:
        """The estimate for ``name`` (``"ddp"``, ``"zero1"``..., ``"fsdp_zero2"``...).

        With ``checkpointing=True`` the activations are those of full activation
        checkpointing (what :class:`ActivationCheckpointing` does).
        """
        _validation.choice("name", name, self.names, why="is not a planned strategy")
        _validation.boolean("checkpointing", checkpointing)
        estimate = self.estimates[name]
        if checkpointing and self.activations_checkpointed is not None:
            return replace(estimate, activations=self.activations_checkpointed)
        return estimate

    def fits(self, device_memory: float, headroom: float = 0.9) -> list[tuple[str, bool]]:
        """``(name, checkpointing)`` pairs whose total is within ``headroom`` of the memory.

        ``headroom`` leaves room for what no formula sees: the CUDA context, allocator
        fragmentation, communication buffers and kernels' workspaces (0.9 is a common
        margin; lower it for long-sequence runs with irregular shapes).
        """
        budget = _budget(device_memory, headroom)
        found = []
        for name in self.names:
            for checkpointing in (False, True) if self.activations else (False,):
                if self.per_device(name, checkpointing).total <= budget:
                    found.append((name, checkpointing))
        return found

    def recommend(self, device_memory: float, headroom: float = 0.9) -> tuple[str, bool] | None:
        """The preset to use: the fastest that fits, without recomputation if possible.

        Order: plain DDP (least communication), the ZeRO-2 presets (DDP's
        communication volume), then the same with activation checkpointing (about a
        third more compute), then optimizer offload, then ZeRO-3 (half again the
        communication). None when nothing fits.
        """
        fitting = set(self.fits(device_memory, headroom))
        for checkpointing in (False, True):
            for name in _PREFERENCE:
                if (name, checkpointing) in fitting:
                    return name, checkpointing
        return None

    def table(self, device_memory: float | None = None, headroom: float = 0.9) -> str:
        """A text table in GiB, one row per strategy, with what fits."""
        head = ["strategy", "params", "grads", "optimizer", "model states", "step tmp"]
        if self.activations is not None:
            head += ["activations", "total", "w/ ckpt"]
        else:
            head += ["total"]
        if device_memory is not None:
            head += ["fits"]
        fitting = set(self.fits(device_memory, headroom)) if device_memory is not None else set()
        _validation.positive_number("headroom", headroom, example=0.9)
        rows = [head]
        for name in self.names:
            est = self.per_device(name)
            row = [name] + [_gib(v) for v in (est.params, est.grads, est.optimizer)]
            row += [_gib(est.model_states), _gib(est.transient)]
            if self.activations is not None:
                row += [_gib(est.activations), _gib(est.total),
                        _gib(self.per_device(name, checkpointing=True).total)]  # fmt: skip
            else:
                row.append(_gib(est.total))
            if device_memory is not None:
                row.append(
                    "yes" if (name, False) in fitting
                    else "with ckpt" if (name, True) in fitting
                    else "no"
                )  # fmt: skip
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                           enumerate(zip(r, widths, strict=True))) for r in rows]  # fmt: skip
        host = self.estimates["deepspeed_zero2_offload"].host
        buckets = self.estimates["ddp"].buckets
        ddp = (f"ddp's total holds {_gib(buckets)} GiB of DDP's gradient buckets beside the "
               f"gradients (Lightning's default), which the kit's DDP strategies "
               f"(gradient_as_bucket_view=True) do not; " if buckets else "")  # fmt: skip
        lines.append(f"(GiB per device; step tmp: the optimizer step's temporaries; total: the "
                     f"higher of the forward/backward and the optimizer step's peaks; {ddp}"
                     f"deepspeed_zero2_offload also needs {_gib(host)} GiB of host memory, "
                     f"DeepSpeed's estimate)")  # fmt: skip
        return "\n".join(lines)


def _gib(value: int) -> str:
    return f"{value / _GIB:,.2f}"


def _budget(device_memory: float, headroom: float) -> float:
    memory = _validation.positive_number("device_memory", device_memory, example=80 * _GIB,
                                         hint="bytes, e.g. 80 * 2**30 for 80 GiB")  # fmt: skip
    return memory * _validation.positive_number("headroom", headroom, example=0.9)


def activation_bytes(
    batch_size: int,
    seq_len: int,
    hidden_size: int,
    n_layers: int,
    n_heads: int,
    *,
    bytes_per_value: int = 2,
    fused_attention: bool = False,
    recompute: bool = False,
) -> int:
    """Activations a transformer stack keeps for backward (Korthikanti et al. 2022).

    Per layer ``s b h (34 + 5 a s / h)`` bytes with 16-bit activations, no tensor or
    sequence parallelism (their Eq. 1). A fused attention kernel keeps no ``a s^2``
    score and softmax matrices, which drops the ``5 a s / h`` term (as their selective
    recomputation does). Full recomputation keeps only each layer's input,
    ``2 s b h``. Scaled by ``bytes_per_value / 2`` for other activation dtypes.
    """
    s, b, h, a = seq_len, batch_size, hidden_size, n_heads
    if recompute:
        per_layer = 2 * s * b * h
    else:
        per_layer = s * b * h * 34 + (0 if fused_attention else 5 * a * s * s * b)
    return per_layer * n_layers * bytes_per_value // 2


def plan_memory(
    n_params: float,
    n_devices: int,
    *,
    trainable_params: float | None = None,
    optimizer: OptimizerName = "adam",
    precision: PrecisionName = "mixed",
    batch_size: int | None = None,
    seq_len: int | None = None,
    hidden_size: int | None = None,
    n_layers: int | None = None,
    n_heads: int | None = None,
    fused_attention: bool = False,
    device: DeviceName = "cuda",
    gradient_as_bucket_view: bool = False,
    static_graph: bool = False,
) -> MemoryPlan:
    """Per-device memory of DDP, ZeRO-1/2/3 and the kit's ZeRO-2 presets.

    ``"ddp"``, ``"zero1"``, ``"zero2"``, ``"zero3"`` follow the ZeRO paper's
    accounting: with mixed-precision Adam, 2 bytes of 16-bit weights, 2 of 16-bit
    gradients and K = 12 of fp32 master weights and moments per parameter, of which
    stage 1 partitions the K, stage 2 also the gradients, stage 3 everything.

    The presets follow what the engines allocate:

    - ``"deepspeed_zero2"``: 16-bit weights whole; fp32 master weights, 16- and
      32-bit gradient partitions and fp32 moments partitioned (2 + 18 / N bytes per
      parameter in mixed precision, DeepSpeed's own
      ``estimate_zero2_model_states_mem_needs``; in fp32, 4 + 20 / N: two fp32
      gradient partitions, the one reduced into and the flat copy its step makes).
    - ``"deepspeed_zero2_offload"``: only the 16-bit weights on the device; the rest
      in host memory (``host``: DeepSpeed's estimate, with its 1.5 buffer factor).
    - ``"fsdp_zero2"``: the fp32 flat parameter, its gradient and the moments
      sharded (4 + 4 + 8 per parameter over N), and the unsharded compute copy of the
      weights alive from forward to the end of backward (2 bytes, or 4 in fp32).
    - ``"fsdp2_zero2"``: FSDP2's fp32 parameter shards, gradient shards and moments
      (16 / N between steps), and every unit's parameters gathered in fp32 from its
      forward to the end of its backward: 4 + 16 / N when backward begins, in fp32 and
      under the Trainer's ``"bf16-mixed"`` (autocast keeps the parameters fp32). With
      ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` the gathered copy is 2 bytes
      (2 + 16 / N, as ``"fsdp_zero2"``); under ``"bf16-true"`` everything is bf16,
      2 + 8 / N and 8 / N between steps. Neither is a row here.

    Frozen parameters hold weights only: no gradients, no optimizer state.

    ``total`` is the higher of two peaks that never meet (see :class:`MemoryEstimate`):
    forward/backward, with the activations, and the optimizer step, after them.

    - The step's temporaries (``transient``): on an accelerator torch's Adam and AdamW
      run their foreach path and allocate ``sqrt(exp_avg_sq)`` for all the parameters
      they update at once, 4 bytes each on the device's shard. On CPU they run the
      single-tensor path, one tensor at a time, whose ``exp_avg_sq.sqrt() /
      bias_correction`` holds two temporaries of that tensor: negligible for DDP's
      and FSDP's many tensors (two copies of the largest one, which the plan does not
      know), 8 bytes per parameter of the flat partition that DeepSpeed and the
      ``zero*`` rows hand the optimizer. None when the step is offloaded, none for SGD.
    - DDP's ``buckets``: without ``gradient_as_bucket_view`` (Lightning's and torch's
      default) DDP's communication buckets are a second copy of the gradients, alive
      in both phases (4 bytes per trainable parameter). With it (the kit's DDP
      strategies' default) the gradients are views into the buckets. DDP lays its
      buckets out again in the second iteration's forward, while the gradients, views
      of the first ones, are still referenced (Lightning zeroes them after forward):
      the kit's strategies free them just before, so no second copy ever exists.
      Lightning's own ``DDPStrategy(gradient_as_bucket_view=True)`` does not: its
      forward/backward peak is that of ``gradient_as_bucket_view=False``, its step's
      that of ``True``. ``static_graph`` moves the rebuild to the third iteration and
      changes no byte (measured).
    - DeepSpeed's fp32 gradient partition (``step_only``) exists only in the step;
      FSDP's unsharded weights (``compute_only``) only in forward and backward.

    ``benchmarks/memory.py`` checks these against torch's own allocation records.

    Args:
        n_params: all parameters (e.g. ``7e9``).
        n_devices: data-parallel devices in all.
        trainable_params: those that train (default: all).
        optimizer: ``"adam"``/``"adamw"`` (two moments) or ``"sgd"`` (momentum).
        precision: ``"mixed"`` (16-bit weights and gradients for compute, an fp32
            master copy; ``16-mixed``/``bf16-mixed``) or ``"fp32"``.
        batch_size: micro-batch per device, for activations (give all four of
            ``batch_size``, ``seq_len``, ``hidden_size``, ``n_layers``, or none).
        seq_len: sequence length.
        hidden_size: the transformer's hidden size.
        n_layers: transformer layers.
        n_heads: attention heads (default: hidden_size / 64).
        fused_attention: attention by a fused kernel (no ``s^2`` matrices kept).
        device: where the optimizer steps: ``"cuda"`` (any accelerator; foreach Adam)
            or ``"cpu"`` (single-tensor Adam).
        gradient_as_bucket_view: DDP's gradients as views into its buckets, as the
            kit's DDP strategies (``ddp_powersgd``, ``ddp_fp16_compress``,
            ``ddp_bf16_compress``) run by default; ``False`` (Lightning's
            ``strategy="ddp"``) adds the buckets' 4 bytes per trainable parameter to
            the ``"ddp"`` row.
        static_graph: DDP's ``static_graph``; recorded, the bytes are the same.

    Example::

        >>> plan = plan_memory(7e9, 8)
        >>> round(plan.per_device("ddp").model_states / 2**30, 1)  # 16 bytes/param
        104.3
        >>> round(plan.per_device("zero2").model_states / 2**30, 1)  # 2 + 14 / 8
        24.4
        >>> lightning = plan.per_device("ddp").total  # Lightning's "ddp": + its buckets
        >>> kit = plan_memory(7e9, 8, gradient_as_bucket_view=True).per_device("ddp").total
        >>> round((lightning - kit) / 7e9)  # bytes per parameter
        4
    """
    total = int(_validation.number("n_params", n_params, low=1, example=7e9))
    devices = _validation.positive_int("n_devices", n_devices, example=8)
    trainable = total
    if trainable_params is not None:
        trainable = int(_validation.number(
            "trainable_params", trainable_params, low=0, high=total, example=total,
            hint=f"all parameters that train, at most `n_params` ({total:,})",
        ))  # fmt: skip
    _validation.choice("optimizer", optimizer, tuple(_STATES))
    _validation.choice("precision", precision, _PRECISIONS)
    shape = {"batch_size": batch_size, "seq_len": seq_len, "hidden_size": hidden_size,
             "n_layers": n_layers}  # fmt: skip
    given = {k: v for k, v in shape.items() if v is not None}
    if given and len(given) < len(shape):
        missing = ", ".join(f"`{k}`" for k in shape if k not in given)
        raise SpeedkitConfigError(
            f"Activations need all of the model's shape; also give {missing}."
        )
    for name, value in given.items():
        _validation.positive_int(name, value)
    _validation.optional(_validation.positive_int, "n_heads", n_heads)
    _validation.boolean("fused_attention", fused_attention)
    _validation.choice("device", device, _DEVICES, hint="where the optimizer steps")
    bucket_view = _validation.boolean("gradient_as_bucket_view", gradient_as_bucket_view)
    static = _validation.boolean("static_graph", static_graph)
    states = _STATES[optimizer]
    mixed = precision == "mixed"
    weight = 2 if mixed else 4  # bytes of the weights (and gradients) compute uses
    master = 4 if mixed else 0  # the fp32 copy of the trainable weights mixed precision keeps
    moments = 4 * states  # fp32 optimizer state
    # The optimizer step's temporaries, per parameter it updates. Foreach Adam/AdamW
    # (accelerators) allocates sqrt(exp_avg_sq) for the whole group at once; the
    # single-tensor path (CPU) sqrt(v) / bias_correction, two temporaries of one tensor
    # at a time: only a flat partition (DeepSpeed, the zero* rows) makes that large.
    foreach = device != "cpu"
    step_temp = (4 if foreach else 0) if states == 2 else 0
    flat_step_temp = (4 if foreach else 8) if states == 2 else 0
    n = devices

    def stage(level: int) -> MemoryEstimate:
        k = master + moments  # the paper's K (12 for mixed-precision Adam)
        step = _div(flat_step_temp * trainable, n) if level >= 1 else step_temp * trainable
        return MemoryEstimate(
            params=_div(weight * total, n) if level >= 3 else weight * total,
            grads=_div(weight * trainable, n) if level >= 2 else weight * trainable,
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
    # DeepSpeed ZeRO-2 keeps a 16-bit and an fp32 gradient partition in mixed precision,
    # and an fp32 copy of its weight partition in any precision (a clone even in fp32).
    # In fp32 its step still flattens the reduced partition into a new tensor beside it
    # (the cast to fp32 that makes the second partition in mixed precision is then a
    # no-op, the flattening is not): two fp32 gradient partitions. The fp32 one exists
    # only in the step.
    estimates["deepspeed_zero2"] = MemoryEstimate(
        params=weight * total + _div(4 * trainable, n),
        grads=_div((2 + 4 if mixed else 4 + 4) * trainable, n),
        optimizer=_div(moments * trainable, n),
        activations=0,
        transient=_div(flat_step_temp * trainable, n),
        step_only=_div(4 * trainable, n),
    )
    estimates["deepspeed_zero2_offload"] = MemoryEstimate(
        params=weight * total,
        grads=0,
        optimizer=0,
        activations=0,
        host=int(trainable * max(4 * n, 16) * 1.5),  # DeepSpeed's estimate, buffers included
    )
    # FSDP's sharded flat parameter is fp32; SHARD_GRAD_OP keeps the unsharded compute copy
    # from forward to the end of backward. (One fp32 rank needs no separate copy; counted
    # anyway, so that the plan never grows with the device count.)
    estimates["fsdp_zero2"] = MemoryEstimate(
        params=weight * total + _div(4 * total, n),
        grads=_div(4 * trainable, n),
        optimizer=_div(moments * trainable, n),
        activations=0,
        transient=_div(step_temp * trainable, n),
        compute_only=weight * total,
    )
    # FSDP2 keeps fp32 parameter shards (DTensors), gradient shards and moments: 16 / N
    # between steps. With reshard_after_forward=False each unit's parameters, gathered in
    # fp32 under the Trainer's "32-true" and "bf16-mixed" (autocast casts per operation),
    # stay whole from its forward to the end of its backward: all of them at once when
    # backward begins, 4 + 16 / N. (Its MixedPrecisionPolicy with bf16 parameters gathers
    # 2 bytes instead; one unit's unsharded gradient lives briefly before its
    # reduce-scatter, as the unit frees its parameters.)
    estimates["fsdp2_zero2"] = MemoryEstimate(
        params=_div(4 * total, n) + 4 * total,
        grads=_div(4 * trainable, n),
        optimizer=_div(moments * trainable, n),
        activations=0,
        transient=_div(step_temp * trainable, n),
        compute_only=4 * total,
    )

    activations = checkpointed = None
    if batch_size and seq_len and hidden_size and n_layers:
        heads = n_heads or max(1, hidden_size // 64)
        shape_args = (batch_size, seq_len, hidden_size, n_layers, heads)
        act_bytes = 4 if precision == "fp32" else 2
        activations = activation_bytes(
            *shape_args, bytes_per_value=act_bytes, fused_attention=fused_attention
        )
        checkpointed = activation_bytes(*shape_args, bytes_per_value=act_bytes, recompute=True)
        estimates = {name: replace(e, activations=activations) for name, e in estimates.items()}
    return MemoryPlan(total, trainable, devices, optimizer, precision, activations,
                      checkpointed, estimates, device, bucket_view, static)  # fmt: skip


def _div(value: int, n: int) -> int:
    return math.ceil(value / n)


def count_parameters(factory: str) -> tuple[int, int]:
    """``(all, trainable)`` parameters of ``"module:function"``'s model, built on meta.

    The function is called with no arguments under ``torch.device("meta")``: no
    memory is allocated, so a 70B model counts in a second.
    """
    module_name, sep, attr = factory.partition(":")
    if not sep or not module_name or not attr:
        raise SpeedkitConfigError(
            f"`--model` takes MODULE:FACTORY, e.g. 'speedkit_examples.vlm:VLM'; got {factory!r}."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise SpeedkitConfigError(
            f"`--model {factory}`: cannot import {module_name!r}: {err}"
        ) from err
    build = getattr(module, attr, None)
    if not callable(build):
        raise SpeedkitConfigError(f"`--model {factory}`: {module_name} has no callable {attr!r}.")
    with torch.device("meta"):
        model = build()
    if not isinstance(model, torch.nn.Module):
        raise SpeedkitConfigError(
            f"`--model {factory}` returned {type(model).__name__}, not a torch.nn.Module."
        )
    seen: dict[int, torch.nn.Parameter] = {id(p): p for p in model.parameters()}  # tied once
    return (sum(p.numel() for p in seen.values()),
            sum(p.numel() for p in seen.values() if p.requires_grad))  # fmt: skip
