"""DeepSpeedZeRO2Strategy (``"deepspeed_zero2"``, ``"deepspeed_zero2_offload"``)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_speedkit import _compat, _imports, _validation
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = ["DeepSpeedZeRO2Strategy", "zero2_bucket_size"]

_MIN_BUCKET = 2**20  # elements: below ~4 MB a message costs its latency, not its bytes
_MAX_BUCKET = 500_000_000  # DeepSpeed's own default
_BUCKETS_PER_BACKWARD = 8


def zero2_bucket_size(model: nn.Module) -> int:
    """Elements per reduce/all-gather bucket for a model: about 8 buckets per backward.

    Enough buckets that reduction overlaps backward, each at least as large as the
    largest trainable parameter and at least 2**20 elements, at most DeepSpeed's
    default of 5e8.

    Example::

        >>> from torch import nn
        >>> zero2_bucket_size(nn.Linear(4096, 4096))  # its weight: 16.8M elements
        16777216
    """
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    if not sizes:
        return _MIN_BUCKET
    wanted = max(max(sizes), math.ceil(sum(sizes) / _BUCKETS_PER_BACKWARD), _MIN_BUCKET)
    return int(min(_MAX_BUCKET, wanted))


class DeepSpeedZeRO2Strategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO stage 2, tuned, on CUDA and on CPU.

    Gradients and optimizer state are partitioned across ranks; ``overlap_comm``
    reduces gradients while backward runs, ``contiguous_gradients`` copies them into
    one buffer as they are produced (less fragmentation), and the reduce and
    all-gather bucket sizes come from the model (:func:`zero2_bucket_size`) rather
    than DeepSpeed's fixed 5e8 elements, which for small and mid-sized models means a
    single bucket and no overlap. Precision (``16-mixed``, ``bf16-mixed``) follows the
    Trainer's, as in Lightning's DeepSpeedStrategy.

    ``offload_optimizer=True`` (``"deepspeed_zero2_offload"``) keeps the optimizer
    state and step in host memory: the device holds only parameters and gradients.
    DeepSpeed's ``DeepSpeedCPUAdam`` makes that step fast; other optimizers are
    allowed (they run in plain torch on the CPU) with a warning.

    Lightning's DeepSpeedStrategy refuses ``accelerator="cpu"``; this one fits, validates,
    tests and predicts there on gloo (DeepSpeed compiles a small shared-memory op with
    g++ on first CPU use, cached under ``TORCH_EXTENSIONS_DIR``).

    Args:
        offload_optimizer: optimizer state and step on the host.
        bucket_size: elements per reduce and all-gather bucket; None derives it.
        **kwargs: everything else goes to Lightning's ``DeepSpeedStrategy``.

    Example::

        >>> import lightning as L
        >>> trainer = L.Trainer(strategy="deepspeed_zero2", accelerator="cpu", devices=2)
    """

    def __init__(
        self, offload_optimizer: bool = False, bucket_size: int | None = None, **kwargs: Any
    ) -> None:
        offload_optimizer = _validation.boolean("offload_optimizer", offload_optimizer)
        bucket_size = _validation.optional(
            _validation.positive_int, "bucket_size", bucket_size, example=50_000_000
        )
        accepted = _validation.accepted_keywords(DeepSpeedStrategy.__init__)
        _validation.check_keywords("DeepSpeedZeRO2Strategy", kwargs, accepted)
        if not _imports.DEEPSPEED_AVAILABLE:
            raise SpeedkitConfigError(
                "The `deepspeed_zero2` strategies need DeepSpeed: "
                "pip install 'lightning_speedkit[deepspeed]'"
            )
        # LightningCLI passes DeepSpeedStrategy's defaults (stage=2, zero_optimization=True).
        for fixed, preset in (("stage", 2), ("zero_optimization", True)):
            if kwargs.pop(fixed, preset) != preset:
                raise SpeedkitConfigError(
                    f"`{fixed}` is fixed by the ZeRO-2 preset; use Lightning's "
                    f"`DeepSpeedStrategy({fixed}=...)` for another stage."
                )
        _compat.require_hook(
            DeepSpeedStrategy,
            "_setup_model_and_optimizer",
            "DeepSpeedZeRO2Strategy overrides to set DeepSpeed up on CPU",
        )
        kwargs.setdefault("overlap_comm", True)
        kwargs.setdefault("contiguous_gradients", True)
        super().__init__(stage=2, offload_optimizer=offload_optimizer, **kwargs)
        self.offload = offload_optimizer
        self.bucket_size = bucket_size

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "deepspeed_zero2", cls, description="DeepSpeed ZeRO-2, buckets sized to the model"
        )
        strategy_registry.register(
            "deepspeed_zero2_offload",
            cls,
            description="DeepSpeed ZeRO-2 with the optimizer on the host",
            offload_optimizer=True,
        )

    @property
    def _on_cpu(self) -> bool:
        return not isinstance(self.accelerator, CUDAAccelerator)

    def setup_environment(self) -> None:
        if self._on_cpu:  # Lightning's check would refuse; DDP's set-up is what is needed
            DDPStrategy.setup_environment(self)
        else:
            super().setup_environment()

    def setup_distributed(self) -> None:
        if not self._on_cpu:
            super().setup_distributed()
            return
        # Lightning validates CUDA device indices here; CPU devices have none.
        reset_seed()
        self.set_world_ranks()
        _compat.init_deepspeed_distributed(self)

    def setup(self, trainer: Any) -> None:
        config: dict[str, Any] = self.config if self.config is not None else {}
        zero = config.setdefault("zero_optimization", {})
        if self.model is not None and zero.get("stage") == 2:
            size = self.bucket_size or zero2_bucket_size(self.model)
            zero["reduce_bucket_size"] = zero["allgather_bucket_size"] = size
            rank_zero_info(f"deepspeed_zero2: buckets of {size:,} elements")
        if self.offload:
            # Any optimizer may run its step on the host; DeepSpeedCPUAdam is the fast one.
            config["zero_force_ds_cpu_optimizer"] = False
        super().setup(trainer)

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Backward through DeepSpeed's engine, the loss divided by the accumulation once.

        Lightning's loop divides the loss by ``accumulate_grad_batches`` and gives the same
        number to DeepSpeed as ``gradient_accumulation_steps``, whose ``engine.backward``
        divides by it again by default: with two micro-batches per step each step was
        half of DDP's (exactly, with SGD; gradient clipping's threshold doubled). Where
        Lightning divides, the engine is told not to (``scale_wrt_gas=False``); where it
        does not (``accumulate_grad_batches=1``, as AccumulationScheduler sets it while it
        moves the engine's own window), the engine divides by its window.
        """
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.accumulate_grad_batches > 1:
            kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def init_deepspeed(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not self._on_cpu or (trainer is not None and trainer.training):
            super().init_deepspeed()
            return
        # validate, test, predict on CPU: Lightning's inference set-up passes the CUDA
        # index (None on CPU) as DeepSpeed's device rank, which DeepSpeed compares to 0.
        self._initialize_cpu_inference()

    def _initialize_cpu_inference(self) -> None:
        """Lightning's inference engine (no optimizer; ZeRO-2 shards nothing without one)."""
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        config: dict[str, Any] = self.config if self.config is not None else {}
        # DeepSpeed's throughput timers want a micro-batch size, as in Lightning's.
        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        inference_config.update({k: config[k] for k in ("fp16", "bf16") if k in config})
        assert self.model is not None  # setup() wraps the LightningModule before this
        remove_module_hooks(self.model)
        engine, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=0),
            config=inference_config,
            model=self.model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )
        self.model = engine

    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: Any, lr_scheduler: Any = None
    ) -> tuple[Any, Any]:
        if not self._on_cpu:
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        import deepspeed

        if self.offload and type(optimizer).__name__ != "DeepSpeedCPUAdam":
            rank_zero_warn(
                f"deepspeed_zero2_offload: {type(optimizer).__name__} steps in plain torch on "
                f"the host; deepspeed.ops.adam.DeepSpeedCPUAdam is several times faster there."
            )
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=0),  # Lightning passes the CUDA index: None
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer
