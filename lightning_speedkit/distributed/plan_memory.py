"""plan_memory: per-device memory of each data-parallel strategy, before you run out of it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from lightning_speedkit import _validation
from lightning_speedkit.distributed._memory_estimates import (
    OPTIMIZERS,
    MemoryEstimate,
    ParamBytes,
    estimate_strategies,
)
from lightning_speedkit.distributed._memory_estimates import PAPER as PAPER
from lightning_speedkit.distributed._memory_estimates import PRESETS as PRESETS
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["MemoryEstimate", "MemoryPlan", "count_parameters", "plan_memory"]

OptimizerName = Literal["adam", "adamw", "sgd"]
PrecisionName = Literal["mixed", "fp32"]
DeviceName = Literal["cuda", "cpu"]
_PRECISIONS = ("mixed", "fp32")
_DEVICES = ("cuda", "cpu")
_GIB = 2**30

#: The order of preference when several strategies fit: less communication and no
#: offload first.
_PREFERENCE = ("ddp", "fsdp_zero2", "fsdp2_zero2", "deepspeed_zero2", "zero1",
               "deepspeed_zero2_offload", "zero3")  # fmt: skip


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
    total, trainable, devices = _counts(n_params, n_devices, trainable_params)
    _validation.choice("optimizer", optimizer, OPTIMIZERS)
    _validation.choice("precision", precision, _PRECISIONS)
    shape = _model_shape(batch_size=batch_size, seq_len=seq_len, hidden_size=hidden_size,
                         n_layers=n_layers)  # fmt: skip
    _validation.optional(_validation.positive_int, "n_heads", n_heads)
    _validation.boolean("fused_attention", fused_attention)
    _validation.choice("device", device, _DEVICES, hint="where the optimizer steps")
    bucket_view = _validation.boolean("gradient_as_bucket_view", gradient_as_bucket_view)
    static = _validation.boolean("static_graph", static_graph)
    size = ParamBytes.of(optimizer, precision, device)
    estimates = estimate_strategies(total, trainable, devices, size, bucket_view)
    activations = checkpointed = None
    if shape is not None:
        batch, seq, hidden, layers = shape
        if n_heads is not None and hidden % n_heads:
            fix = f"each head is hidden_size / n_heads wide: give a divisor of {hidden}"
            _validation.fail("n_heads", n_heads, f"must divide `hidden_size={hidden}`", fix)
        heads = n_heads or max(1, hidden // 64)
        shape_args = (batch, seq, hidden, layers, heads)
        act_bytes = 4 if precision == "fp32" else 2
        activations = activation_bytes(
            *shape_args, bytes_per_value=act_bytes, fused_attention=fused_attention
        )
        checkpointed = activation_bytes(*shape_args, bytes_per_value=act_bytes, recompute=True)
        estimates = {name: replace(e, activations=activations) for name, e in estimates.items()}
    return MemoryPlan(total, trainable, devices, optimizer, precision, activations,
                      checkpointed, estimates, device, bucket_view, static)  # fmt: skip


def _counts(
    n_params: float, n_devices: int, trainable_params: float | None
) -> tuple[int, int, int]:
    """``(all, trainable, devices)``, checked: at most ``n_params`` parameters train."""
    total = int(_validation.number("n_params", n_params, low=1, example=7e9))
    devices = _validation.positive_int("n_devices", n_devices, example=8)
    trainable = total
    if trainable_params is not None:
        trainable = int(_validation.number(
            "trainable_params", trainable_params, low=0, high=total, example=total,
            hint=f"all parameters that train, at most `n_params` ({total:,})",
        ))  # fmt: skip
    return total, trainable, devices


def _model_shape(**shape: int | None) -> tuple[int, int, int, int] | None:
    """The four sizes activations need, in the order given, or None when none is given;
    some but not all of them is refused."""
    given = {k: v for k, v in shape.items() if v is not None}
    if given and len(given) < len(shape):
        missing = ", ".join(f"`{k}`" for k in shape if k not in given)
        raise SpeedkitConfigError(
            f"Activations need all of the model's shape; also give {missing}."
        )
    for name, value in given.items():
        _validation.positive_int(name, value)
    if not given:
        return None
    batch, seq, hidden, layers = given.values()
    return batch, seq, hidden, layers


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
