"""FSDP2ZeRO2Strategy (``"fsdp2_zero2"``): ZeRO-2 on PyTorch's ``fully_shard``, no model code."""

from __future__ import annotations

from collections.abc import Collection
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.distributed.fsdp import (
    FSDPModule,
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from lightning_speedkit import _compat, _validation
from lightning_speedkit._blocks import block_instances, repeated_block_types

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FSDP2ZeRO2Strategy", "apply_fsdp2_zero2"]

# The LightningModule methods Lightning calls instead of ``forward``: the root's
# FSDP hooks (gather its own parameters, move the inputs) must run around them.
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
# Precisions Lightning's ModelParallelStrategy takes (it checks only a strategy
# instance, not a registered name, so the preset checks them itself).
_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")
# Arguments of ModelParallelStrategy and fully_shard that the preset sets itself, with
# the one value it accepts (LightningCLI passes ModelParallelStrategy's defaults).
_FIXED: dict[str, Any] = {
    "data_parallel_size": "auto",
    "tensor_parallel_size": "auto",
    "reshard_after_forward": False,
}


def _check_blocks(blocks: Any) -> list[type[nn.Module]] | None:
    """``None`` for ``"auto"``, else the list of block classes."""
    if isinstance(blocks, str) and blocks == "auto":
        return None
    fix = 'pass `blocks="auto"` or a list of module classes, e.g. `blocks=[MyBlock]`'
    if isinstance(blocks, type) and issubclass(blocks, nn.Module):
        _validation.fail("blocks", blocks, "must be a list of module classes",
                         f"pass `blocks=[{blocks.__name__}]`")  # fmt: skip
    if not isinstance(blocks, (list, tuple, set, frozenset)) or not blocks:
        _validation.fail("blocks", blocks, 'must be "auto" or a non-empty list of module classes',
                         fix)  # fmt: skip
    for block in blocks:
        if not (isinstance(block, type) and issubclass(block, nn.Module)):
            _validation.fail("blocks", block, "holds an entry that is not an nn.Module class", fix)
    return list(blocks)


def apply_fsdp2_zero2(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    blocks: str | Collection[type[nn.Module]] = "auto",
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    forward_methods: Collection[str] = (),
) -> list[str]:
    """Shard ``model`` ZeRO-2 style with FSDP2: one ``fully_shard`` unit per block, then the root.

    Each instance of the model's repeated blocks (classes that appear at least twice in
    one ``nn.ModuleList`` or ``nn.Sequential``: transformer layers, ViT blocks) gets
    ``fully_shard(block, reshard_after_forward=False)``, and so does ``model`` itself,
    for the parameters outside the blocks. Parameters, gradients and optimizer state
    are then sharded across ``mesh`` between steps; a unit's parameters are gathered
    in its forward and kept whole until its backward ends (no second all-gather in
    backward: ZeRO-2), and its gradients are reduce-scattered while backward goes on.
    A model that already holds a ``fully_shard`` module is left as it is.

    Needs the default process group. Create the optimizer after this call: the
    parameters become ``DTensor`` shards.

    Args:
        model: the module to shard, in place (its class becomes ``FSDP<Class>``).
        mesh: the 1-D data-parallel device mesh; ``None`` shards over all ranks.
        blocks: ``"auto"`` finds the repeated blocks; or a list of block classes.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` (e.g. bf16 parameters for
            forward and backward, fp32 gradient reduction); ``None`` keeps the
            parameters' dtype.
        offload_policy: FSDP2's ``CPUOffloadPolicy()`` keeps the sharded parameters,
            gradients and optimizer state in host memory; ``None`` keeps them on the
            device.
        forward_methods: methods of ``model`` other than ``forward`` that run the
            model (a LightningModule's ``training_step``): the root's hooks run
            around them too.

    Returns:
        The qualified names of the blocks made FSDP units (empty when the model was
        already sharded, or has no repeated block: then ``model`` is one unit).

    Example::

        >>> import torch.distributed as dist
        >>> from torch import nn
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.ff = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        ...     def forward(self, x):
        ...         return x + self.ff(x)
        >>> model = nn.Sequential(nn.Linear(8, 8), *[Block() for _ in range(2)])
        >>> apply_fsdp2_zero2(model)
        ['1', '2']
        >>> dist.destroy_process_group()
    """
    kinds = _check_blocks(blocks)
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return []
    kinds = repeated_block_types(model) if kinds is None else kinds
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": False}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    if offload_policy is not None:
        options["offload_policy"] = offload_policy
    found = [(name, m) for name, m in block_instances(model, kinds) if m is not model]
    for _, block in found:
        fully_shard(block, **options)
    fully_shard(model, **options)
    for method in forward_methods:
        register_fsdp_forward_method(model, method)
    return [name for name, _ in found]


class FSDP2ZeRO2Strategy(ModelParallelStrategy):
    """ZeRO-2 on FSDP2 (``fully_shard``): gradients and optimizer state sharded, no model code.

    The successor of ``fsdp_zero2`` (FSDP1, which PyTorch deprecates), on the
    per-parameter sharding of ``torch.distributed.fsdp.fully_shard``: parameters are
    ``DTensor`` shards, no flat parameter, so a model's state_dict keys and the
    optimizer's parameters stay those of the plain model. In ``setup`` each instance of
    the model's repeated blocks becomes a ``fully_shard`` unit with
    ``reshard_after_forward=False`` (parameters gathered in forward and kept until the
    block's backward ends: ZeRO-2), then the LightningModule itself, whose step methods
    run the root's hooks. A model whose ``configure_model`` already applied
    ``fully_shard`` is left as the user sharded it.

    Built on Lightning's ``ModelParallelStrategy`` with every process in one
    data-parallel dimension (no tensor parallelism), and no ``configure_model`` needed.
    Runs on CPU (gloo) as well as CUDA.

    Precision follows the Trainer: ``"bf16-mixed"`` runs forward and backward under
    autocast with fp32 parameters (gradients reduced in fp32); ``"bf16-true"`` and
    ``"16-true"`` cast the model. ``"16-mixed"`` (a gradient scaler over sharded
    gradients) is refused, as Lightning's ``ModelParallelStrategy`` refuses it. For
    FSDP2's own mixed precision (bf16 gathers and compute, fp32 gradient reduction),
    pass ``mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32)`` with the Trainer at ``"32-true"``.

    Args:
        blocks: ``"auto"`` (default) finds the repeated blocks; or a list of block
            classes. The classes sharded are in ``strategy.blocks`` after setup.
        save_distributed_checkpoint: ``False`` (default): checkpoints are one file,
            gathered on rank 0, which a plain module loads
            (``torch.load(path)["state_dict"]``). ``True``: a folder with one shard
            per rank (faster to write for large models; Lightning resumes from it).
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` for every unit (see above).
        offload_policy: FSDP2's ``CPUOffloadPolicy()``: sharded parameters,
            gradients and the optimizer step in host memory.
        process_group_backend: ``"nccl"``, ``"gloo"``; default follows the device.
        timeout: collective timeout.
        **kwargs: ``data_parallel_size`` and ``tensor_parallel_size`` (which
            LightningCLI may pass) only as ``"auto"``: the preset puts every process
            in the data-parallel dimension; ``reshard_after_forward`` only as
            ``False``. Any other argument is refused.

    Example::

        >>> import lightning as L
        >>> trainer = L.Trainer(strategy="fsdp2_zero2", accelerator="cpu", devices=2)
    """

    strategy_name = "fsdp2_zero2"

    def __init__(
        self,
        blocks: str | Collection[type[nn.Module]] = "auto",
        save_distributed_checkpoint: bool = False,
        mp_policy: MixedPrecisionPolicy | None = None,
        offload_policy: OffloadPolicy | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        self._blocks = _check_blocks(blocks)
        save_distributed_checkpoint = _validation.boolean(
            "save_distributed_checkpoint", save_distributed_checkpoint
        )
        if mp_policy is not None:
            _validation.instance("mp_policy", mp_policy, MixedPrecisionPolicy,
                                 what="a torch.distributed.fsdp.MixedPrecisionPolicy",
                                 fix="pass e.g. `mp_policy=MixedPrecisionPolicy("
                                     "param_dtype=torch.bfloat16)`, or None")  # fmt: skip
        if offload_policy is not None:
            fix = "pass `offload_policy=CPUOffloadPolicy()`, or None"
            what = "a torch.distributed.fsdp.OffloadPolicy"
            _validation.instance(
                "offload_policy", offload_policy, OffloadPolicy, what=what, fix=fix
            )
        accepted = _validation.accepted_keywords(FSDP2ZeRO2Strategy.__init__) | set(_FIXED)
        _validation.check_keywords("FSDP2ZeRO2Strategy", kwargs, accepted)
        for name, value in kwargs.items():
            preset = _FIXED[name]
            if type(value) is not type(preset) or value != preset:
                _validation.fail(name, value, "is fixed by the ZeRO-2 preset (parameters kept "
                                 "whole from forward to backward, every process in one "
                                 "data-parallel dimension)",
                                 f"leave it out (or pass {preset!r}); for other layouts use "
                                 "Lightning's `ModelParallelStrategy` with a `configure_model`"
                                 )  # fmt: skip
        _compat.require_hook(
            ModelParallelStrategy,
            "_configure_launcher",
            "FSDP2ZeRO2Strategy overrides to check the precision early",
        )
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._mp_policy = mp_policy
        self._offload_policy = offload_policy
        self.blocks: list[type[nn.Module]] = []
        """The block classes made ``fully_shard`` units, after setup."""

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="FSDP2 fully_shard, no reshard after forward (ZeRO-2), blocks found",
        )

    def _configure_launcher(self) -> None:
        # The first hook Lightning calls with the precision plugin set: refuse here, at
        # Trainer construction, what would otherwise fail in the first step.
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if precision not in _PRECISIONS:
            why = "is not supported by fsdp2_zero2 (nor by Lightning's ModelParallelStrategy)"
            _validation.choice("precision", precision, _PRECISIONS, why=why)
        super()._configure_launcher()

    def setup_environment(self) -> None:
        # ZeRO-2 is pure data parallelism: one mesh dimension over every process.
        _compat.set_data_parallel_only(self, self.num_nodes * self.num_processes)
        super().setup_environment()

    def setup(self, trainer: L.Trainer) -> None:
        # ModelParallelStrategy.setup, with the sharding done here instead of asking
        # the user for a configure_model.
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            _validation.fail("strategy", "fsdp2_zero2",
                             "cannot take a model wrapped in FSDP1's FullyShardedDataParallel",
                             'use `strategy="fsdp_zero2"` for FSDP1, or apply `fully_shard` '
                             "in configure_model instead")  # fmt: skip
        self._shard(self.model)
        _compat.materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _compat.optimizers_to_device(self.optimizers, self.root_device)

    def _shard(self, model: nn.Module) -> None:
        if any(isinstance(m, FSDPModule) for m in model.modules()):
            rank_zero_info("fsdp2_zero2: the model applies fully_shard itself; left as it is")
            return
        kinds = repeated_block_types(model) if self._blocks is None else self._blocks
        present = {type(m) for m in model.modules()}
        if self._blocks is not None and not present.intersection(kinds):
            found = ", ".join(kind.__name__ for kind in repeated_block_types(model)) or "none"
            _validation.fail("blocks", [kind.__name__ for kind in kinds],
                             "holds no module class of this model",
                             f'pass `blocks="auto"` (its repeated blocks: {found})')  # fmt: skip
        self.blocks = [kind for kind in kinds if kind in present]
        methods = [m for m in _STEP_METHODS if is_overridden(m, model, L.LightningModule)]
        names = apply_fsdp2_zero2(
            model,
            self.device_mesh["data_parallel"],
            self.blocks or "auto",
            mp_policy=self._mp_policy,
            offload_policy=self._offload_policy,
            forward_methods=methods,
        )
        if names:
            kinds_found = ", ".join(kind.__name__ for kind in self.blocks)
            rank_zero_info(f"fsdp2_zero2: {len(names)} fully_shard units of type {kinds_found}")
        else:
            rank_zero_info("fsdp2_zero2: no repeated blocks found; the model is one unit")
