"""DDPHalfPrecisionStrategy: DDP that all-reduces gradients in fp16 or bf16, on every device.

:func:`half_precision_hook` is the technique, a DDP communication hook that works
without a Trainer (``ddp_model.register_comm_hook(None, half_precision_hook("bf16"))``);
the strategy registers it on every device and launcher, where Lightning's
``DDPStrategy`` registers hooks only on CUDA. ``DDPPowerSGDStrategy`` wraps its
PowerSGD hook in it for ``compress_dtype``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lightning_speedkit import _compat, _validation
from lightning_speedkit.distributed._kit_ddp import (
    GradBucket,
    _comm_hook,
    _KitDDPStrategy,
    refuse_hook_kwargs,
)

__all__ = ["CompressDtype", "DDPHalfPrecisionStrategy", "half_precision_hook"]

CompressDtype = Literal["fp16", "bf16"] | None


def half_precision_hook(
    dtype: Literal["fp16", "bf16"], inner: Callable[..., Any] | None = None
) -> Callable[..., Any]:
    """A DDP communication hook that sends gradients (or ``inner``'s messages) in fp16 or bf16.

    Each bucket is cast to ``dtype`` for the all-reduce and back after, halving the
    bytes sent. torch refuses its bf16 hooks on gloo by checking the hook function's
    name, not what it does; the hook returned here has its own name, so bf16 runs on
    CPU too.

    Args:
        dtype: ``"bf16"`` keeps fp32's range (no overflow) at less precision; ``"fp16"``
            keeps more precision but can overflow on very large gradients. Start with
            ``"bf16"``.
        inner: a hook whose messages are cast instead of the gradients (torch's
            ``powerSGD_hook`` sends its factors in ``dtype`` this way). None: the
            gradients themselves.

    Register it on a ``DistributedDataParallel`` model with
    ``model.register_comm_hook(None, half_precision_hook("bf16"))`` (the state is
    ``inner``'s, None without one).

    Example::

        >>> half_precision_hook("bf16").__name__
        'speedkit_half_precision_hook'
    """
    _validation.choice("dtype", dtype, ("fp16", "bf16"))
    hooks = default_hooks
    if dtype == "fp16":
        wrapped = hooks.fp16_compress_wrapper(inner) if inner else hooks.fp16_compress_hook
    else:
        wrapped = hooks.bf16_compress_wrapper(inner) if inner else hooks.bf16_compress_hook

    @_comm_hook
    def speedkit_half_precision_hook(
        state: Any, bucket: GradBucket
    ) -> torch.futures.Future[Tensor]:
        return wrapped(state, bucket)

    return speedkit_half_precision_hook


class DDPHalfPrecisionStrategy(_KitDDPStrategy):
    """DDP that all-reduces gradients in fp16 or bf16 (halving the bytes), on every device.

    Gradients are cast for communication and back after, so the optimizer sees
    full-precision averages of half-precision sums. bf16 keeps fp32's range (no
    overflow) at less precision; fp16 keeps more precision but can overflow on
    very large gradients.

    Args:
        compress_dtype: ``"fp16"`` (``"ddp_fp16_compress"``) or ``"bf16"``
            (``"ddp_bf16_compress"``).
        gradient_as_bucket_view: gradients are views into DDP's buckets, not a second
            copy (4 bytes per fp32 parameter less). ``False`` is torch's default.
        bucket_cap_mb: DDP's bucket size in megabytes (None: torch's 25).
        static_graph: torch DDP's ``static_graph`` (memory is the same either way).
        **ddp_kwargs: anything else ``DDPStrategy`` or ``DistributedDataParallel`` takes.

    Example::

        >>> import lightning as L
        >>> strategy = DDPHalfPrecisionStrategy("bf16", bucket_cap_mb=50)
        >>> strategy._ddp_kwargs
        {'gradient_as_bucket_view': True, 'bucket_cap_mb': 50.0}
        >>> trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
    """

    def __init__(
        self,
        compress_dtype: Literal["fp16", "bf16"] = "fp16",
        gradient_as_bucket_view: bool = True,
        bucket_cap_mb: float | None = None,
        static_graph: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        _validation.choice("compress_dtype", compress_dtype, ("fp16", "bf16"))
        refuse_hook_kwargs("DDPHalfPrecisionStrategy", ddp_kwargs)
        _compat.require_hook(
            DDPStrategy,
            "_register_ddp_hooks",
            "DDPHalfPrecisionStrategy overrides to register its hook",
        )
        super().__init__(gradient_as_bucket_view, bucket_cap_mb, static_graph, **ddp_kwargs)
        self.compress_dtype: Literal["fp16", "bf16"] = compress_dtype
        self.hook_calls = 0

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for dtype in ("fp16", "bf16"):
            strategy_registry.register(
                f"ddp_{dtype}_compress",
                cls,
                description=f"DDP with {dtype} gradient communication",
                compress_dtype=dtype,
            )

    def _register_ddp_hooks(self) -> None:
        model = self.model
        assert isinstance(model, DistributedDataParallel)
        inner = half_precision_hook(self.compress_dtype)

        @_comm_hook
        def counted(state: Any, bucket: GradBucket) -> torch.futures.Future[Tensor]:
            self.hook_calls += 1
            return inner(state, bucket)

        model.register_comm_hook(None, counted)
