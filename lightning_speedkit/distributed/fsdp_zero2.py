"""FSDPZeRO2Strategy (``"fsdp_zero2"``): native ZeRO-2 with the block wrap policy found for you."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel,
    OptimStateKeyType,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.api import FullOptimStateDictConfig
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from lightning_speedkit import _compat, _validation
from lightning_speedkit._blocks import repeated_block_types

__all__ = ["FSDPZeRO2Strategy"]


class FSDPZeRO2Strategy(FSDPStrategy):
    """FSDP with ``SHARD_GRAD_OP``: gradients and optimizer state sharded, parameters whole.

    ZeRO stage 2 without DeepSpeed. Each rank keeps the full parameters between
    forward and backward (no re-gather in backward, unlike ``FULL_SHARD``) and owns
    1/N of the gradients and optimizer state. The wrap policy is found from the model
    when the strategy sets it up: each instance of its repeated blocks (transformer
    layers, ViT blocks: classes that appear at least twice in one ``ModuleList`` or
    ``Sequential``) becomes an FSDP unit, so gradient reduce-scatter overlaps backward
    block by block.

    Runs on CPU (gloo) as well as CUDA: Lightning's own ``FSDPStrategy`` refuses
    ``accelerator="cpu"``, and torch FSDP needs ``device_id`` there, which this sets.

    Args:
        auto_wrap_policy: ``"auto"`` (default) finds the blocks; or any policy
            Lightning's FSDPStrategy takes (a set of module classes, a callable).
        sharding_strategy: ``"SHARD_GRAD_OP"`` (ZeRO-2, default); others as FSDP.
        **kwargs: everything else goes to Lightning's ``FSDPStrategy``
            (``mixed_precision``, ``cpu_offload``, ``state_dict_type``, ...).
            Checkpoints are consolidated (``state_dict_type="full"``) by default:
            a plain module loads them.

    Example::

        >>> import lightning as L
        >>> trainer = L.Trainer(strategy="fsdp_zero2", accelerator="cpu", devices=2)
    """

    strategy_name = "fsdp_zero2"

    def __init__(
        self,
        auto_wrap_policy: Any = "auto",
        sharding_strategy: Any = "SHARD_GRAD_OP",
        **kwargs: Any,
    ) -> None:
        if isinstance(auto_wrap_policy, str) and auto_wrap_policy != "auto":
            why = 'must be "auto" or a wrap policy (a set of module classes, a callable)'
            fix = 'pass `auto_wrap_policy="auto"` or e.g. `{MyBlock}`'
            _validation.fail("auto_wrap_policy", auto_wrap_policy, why, fix)
        if isinstance(sharding_strategy, str):
            names = [s.name for s in ShardingStrategy]
            if sharding_strategy.upper() not in names:
                _validation.choice("sharding_strategy", sharding_strategy, names)
        accepted = _validation.accepted_keywords(
            FSDPStrategy.__init__,
            FullyShardedDataParallel.__init__,
            exclude=("module", "device_id"),  # Lightning passes these itself
        )
        _validation.check_keywords("FSDPZeRO2Strategy", kwargs, accepted)
        _compat.require_hook(
            FSDPStrategy,
            "_setup_model",
            "FSDPZeRO2Strategy overrides to find the blocks and wrap on CPU",
        )
        self._find_blocks = isinstance(auto_wrap_policy, str) and auto_wrap_policy == "auto"
        super().__init__(
            auto_wrap_policy=None if self._find_blocks else auto_wrap_policy,
            sharding_strategy=sharding_strategy,
            **kwargs,
        )
        self.blocks: list[type[nn.Module]] = []
        """The block classes found (``auto_wrap_policy="auto"``), after setup."""
        self._root: FullyShardedDataParallel | None = None  # the wrapper of the whole model

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="FSDP SHARD_GRAD_OP (ZeRO-2), block wrap policy found automatically",
        )

    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Wrap ``model``; a model already wrapped whole (``validate`` or ``test`` with the
        Trainer that fitted it) gets the wrapper it had: its parameters are views of that
        wrapper's flat parameter, which a second wrapper would flatten again."""
        if self._root is not None and self._root.module is model:
            return super()._setup_model(self._root)
        wrapped = self._wrap(model)
        if isinstance(wrapped, FullyShardedDataParallel) and wrapped.module is model:
            self._root = wrapped
        return wrapped

    def _wrap(self, model: nn.Module) -> nn.Module:
        already = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
        if self._find_blocks and not already:
            self.blocks = repeated_block_types(model)
            if self.blocks:
                self.kwargs["auto_wrap_policy"] = ModuleWrapPolicy(set(self.blocks))
                names = ", ".join(kind.__name__ for kind in self.blocks)
                rank_zero_info(f"fsdp_zero2: one FSDP unit per block of type {names}")
            else:
                rank_zero_info("fsdp_zero2: no repeated blocks found; the model is one FSDP unit")
        if self.root_device.type != "cpu" or already:
            return super()._setup_model(model)
        # Lightning passes device_id=root_device.index, None on CPU, which FSDP refuses.
        # Wrap here; Lightning's own set-up then sees a wrapped model and does the rest
        # (it would drop a policy left in kwargs, with a warning: hold it aside).
        policy = self.kwargs.pop("auto_wrap_policy", None)
        try:
            wrapped = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                auto_wrap_policy=policy,
                **self.kwargs,
            )
            return super()._setup_model(wrapped)
        finally:
            if policy is not None:
                self.kwargs["auto_wrap_policy"] = policy

    # torch FSDP's full state dict with offload_to_cpu=True, which Lightning asks for,
    # frees the gathered parameters' storage before cloning them when they already live
    # on the CPU: the clone reads freed memory (a segfault on torch 2.13). On CPU the
    # gathered copy is already in host memory, so gather without "offloading".

    def _cpu_full_state(self) -> Any:
        if self.root_device.type != "cpu" or _compat.fsdp_state_dict_type(self) != "full":
            return None
        return FullyShardedDataParallel.state_dict_type(
            module=self.model,  # type: ignore[arg-type]
            state_dict_type=StateDictType.FULL_STATE_DICT,
            state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        context = self._cpu_full_state()
        if context is None:
            return super().lightning_module_state_dict()
        assert self.model is not None
        with context:
            return self.model.state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        context = self._cpu_full_state()
        if context is None:
            return super().optimizer_state(optimizer)
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        with context:
            model: Any = self.model
            state: dict[str, Any] = FullyShardedDataParallel.optim_state_dict(model, optimizer)
            if self.global_rank == 0:  # the standard layout, as Lightning stores it
                state = FullyShardedDataParallel.rekey_optim_state_dict(
                    state, OptimStateKeyType.PARAM_ID, model
                )
        return state
