"""torch's and Lightning's strategy, compile, dispatch and autograd internals."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

try:  # the base class of count_flops' counter
    from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
except ImportError as error:  # pragma: no cover - only on a torch that moved it
    raise ImportError(
        f"This torch ({torch.__version__}) has no "
        f"`torch.utils._python_dispatch.TorchDispatchMode`, which count_flops and SpeedMonitor "
        f"count FLOPs with. Please report the version."
    ) from error

if TYPE_CHECKING:
    from torch._ops import OpOverload as OpOverload  # the operators a dispatch mode sees


from lightning_speedkit._compat._reading import _missing, _private

# --- torch and Lightning names the kit's other modules need --------------------------------------
#
# Each function below reads one private name. Where the name is gone from the installed
# torch or Lightning, it raises the error _missing builds: the version, the name, and the
# feature that needs it. tests/test_compat.py lists every private name read here and checks
# that each one resolves on the installed versions.


def require_hook(base: type, name: str, feature: str) -> None:
    """Check that Lightning's ``base`` still has the private method ``name``, which one of
    the kit's strategies overrides (Lightning calls it during its own set-up).

    Called from the strategy's constructor: were the method renamed, the override would
    silently never run.
    """
    if not callable(getattr(base, name, None)):
        raise _missing("Lightning", f"{base.__name__}.{name}", feature)


def ddp_kwargs(strategy: Any) -> dict[str, Any]:
    """The keyword arguments a ``DDPStrategy`` passes to ``DistributedDataParallel``."""
    kwargs = _private(
        strategy, "_ddp_kwargs", "Lightning", "DDPStrategy._ddp_kwargs",
        "the kit's DDP strategies read DDP's options from",
    )  # fmt: skip
    return cast("dict[str, Any]", kwargs)


def fsdp_state_dict_type(strategy: Any) -> str:
    """An ``FSDPStrategy``'s ``state_dict_type`` (``"full"`` or ``"sharded"``)."""
    value = _private(
        strategy, "_state_dict_type", "Lightning", "FSDPStrategy._state_dict_type",
        "FSDPZeRO2Strategy reads to save checkpoints on CPU",
    )  # fmt: skip
    return str(value)


def set_data_parallel_only(strategy: Any, size: int) -> None:
    """Make a ``ModelParallelStrategy`` build a one-dimensional mesh: ``size`` processes of
    data parallelism, no tensor parallelism (what its ``setup_environment`` then reads)."""
    for name in ("_data_parallel_size", "_tensor_parallel_size"):
        if not hasattr(strategy, name):
            raise _missing(
                "Lightning", f"ModelParallelStrategy.{name}",
                "FSDP2ZeRO2Strategy sets to put every process in one data-parallel dimension",
            )  # fmt: skip
    strategy._data_parallel_size = size
    strategy._tensor_parallel_size = 1


def materialize_distributed_module(module: Any, device: Any) -> None:
    """Lightning's ``_materialize_distributed_module``: parameters left on the meta device
    after sharding are materialised on ``device`` (``reset_parameters``)."""
    try:
        from lightning.fabric.utilities.init import _materialize_distributed_module
    except ImportError:
        raise _missing(
            "Lightning", "lightning.fabric.utilities.init._materialize_distributed_module",
            "FSDP2ZeRO2Strategy uses to materialise a sharded model",
        ) from None  # fmt: skip
    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: Any, device: Any) -> None:
    """Lightning's ``_optimizers_to_device``: moves the optimizers' state to ``device``."""
    try:
        from lightning.fabric.utilities.optimizer import _optimizers_to_device
    except ImportError:
        raise _missing(
            "Lightning", "lightning.fabric.utilities.optimizer._optimizers_to_device",
            "FSDP2ZeRO2Strategy uses to move optimizer state to the device",
        ) from None  # fmt: skip
    _optimizers_to_device(optimizers, device)


def init_deepspeed_distributed(strategy: Any) -> None:
    """``DeepSpeedStrategy._init_deepspeed_distributed``: DeepSpeed's process group set-up."""
    init = _private(
        strategy, "_init_deepspeed_distributed", "Lightning",
        "DeepSpeedStrategy._init_deepspeed_distributed",
        "DeepSpeedZeRO2Strategy calls to set DeepSpeed up on CPU",
    )  # fmt: skip
    init()


def powersgd_compresses(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """Whether torch's ``powerSGD_hook`` compresses a ``rows`` x ``cols`` matrix at ``rank``
    (its private ``_should_compress``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    should_compress = _private(
        powerSGD_hook, "_should_compress", "torch",
        "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook._should_compress",
        "DDPPowerSGDStrategy uses to lay PowerSGD's state out by parameter",
    )  # fmt: skip
    return bool(should_compress(rows, cols, rank, min_compression_rate)[0])


def compiled_call_impl(module: Any) -> Callable[..., Any] | None:
    """The call ``nn.Module.compile`` installed on ``module`` (torch keeps it in the
    private ``_compiled_call_impl``), or None where the module is not compiled in place."""
    return cast("Callable[..., Any] | None", getattr(module, "_compiled_call_impl", None))


def compiled_and_eager_calls(module: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A module compiled in place: the call ``nn.Module.compile`` installed, and the
    module's eager one (``nn.Module._call_impl``)."""
    compiled = compiled_call_impl(module)
    eager = getattr(module, "_call_impl", None)
    if compiled is None or eager is None:
        name = "nn.Module._compiled_call_impl" if compiled is None else "nn.Module._call_impl"
        raise _missing("torch", name, "RegionalCompile reads to run a block eagerly")
    return compiled, cast("Callable[..., Any]", eager)


def set_compiled_call(module: Any, call: Callable[..., Any]) -> None:
    """Make ``call`` what ``module(...)`` runs in place of the call ``nn.Module.compile``
    installed (see :func:`compiled_and_eager_calls`)."""
    if compiled_call_impl(module) is None:
        raise _missing("torch", "nn.Module._compiled_call_impl", "RegionalCompile replaces")
    module._compiled_call_impl = call


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` (a FLOP count, say) is active in this thread."""
    depth = _private(
        torch._C, "_len_torch_dispatch_stack", "torch", "torch._C._len_torch_dispatch_stack",
        "RegionalCompile reads to run a block eagerly under a FLOP count",
    )  # fmt: skip
    return bool(depth() > 0)


def dispatch_modes_set_aside() -> contextlib.AbstractContextManager[Any]:
    """torch's ``torch.utils._python_dispatch._disable_current_modes``: run what is inside
    with every active ``TorchDispatchMode`` set aside (restored after)."""
    import torch.utils._python_dispatch as python_dispatch

    set_aside = _private(
        python_dispatch, "_disable_current_modes", "torch",
        "torch.utils._python_dispatch._disable_current_modes",
        "the FLOP count sets aside around FlexAttention, which torch refuses under a dispatch mode",
    )  # fmt: skip
    return cast("contextlib.AbstractContextManager[Any]", set_aside())


def dynamo_callback_handler() -> Any:
    """torch's ``torch._dynamo.callback.callback_handler``: where callbacks that run around
    every compilation are registered (``register_start_callback`` and the like)."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        raise _missing(
            "torch", "torch._dynamo.callback.callback_handler",
            "CompileWatch listens to, to count compilations",
        ) from None  # fmt: skip
    return callback_handler


def compiled_by_lightning(module: Any) -> bool:
    """Whether Lightning runs ``module``'s steps compiled: ``trainer.fit(torch.compile(model))``
    unwraps the ``OptimizedModule`` and compiles the LightningModule's steps, noted in its
    private ``_compiler_ctx``."""
    return getattr(module, "_compiler_ctx", None) is not None


def dynamo_recompile_reasons() -> list[tuple[str, str]]:
    """``(compile id "F/N", reason)`` of each recompilation among the compilations dynamo
    still records (its last 64, ``torch._dynamo.utils.get_compilation_metrics``), oldest
    first. The reason is the first guard that failed, e.g. ``"0/0: tensor 'x' size
    mismatch at index 1..."``. Frame numbers restart after ``torch._dynamo.reset()``, so
    an id may appear more than once: the last is the latest."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:
        raise _missing(
            "torch", "torch._dynamo.utils.get_compilation_metrics",
            "RegionalCompile reads dynamo's recompile reasons from",
        ) from None  # fmt: skip
    return [
        (str(metrics.compile_id), str(metrics.recompile_reason))
        for metrics in get_compilation_metrics()
        if metrics.recompile_reason
    ]


def dynamo_compiled_code() -> list[tuple[str, str, int]]:
    """``(compile id "F/N", file, first line)`` of the function each compilation dynamo still
    records compiled (its last 64, ``torch._dynamo.utils.get_compilation_metrics``), oldest
    first; an attempt that compiled nothing (a recompile limit hit) is left out."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:
        raise _missing(
            "torch", "torch._dynamo.utils.get_compilation_metrics",
            "RegionalCompile reads which function recompiled from",
        ) from None  # fmt: skip
    return [
        (str(metrics.compile_id), str(metrics.co_filename), int(metrics.co_firstlineno))
        for metrics in get_compilation_metrics()
        if metrics.co_filename is not None and metrics.co_firstlineno is not None
    ]


def dynamo_recompile_limit() -> int:
    """``torch._dynamo.config.recompile_limit``: the most graphs dynamo keeps for one
    function (8 by default); a call that fits none of them once it is full runs uncompiled."""
    try:
        from torch._dynamo import config
    except ImportError:
        raise _missing(
            "torch", "torch._dynamo.config",
            "RegionalCompile reads dynamo's recompile limit from",
        ) from None  # fmt: skip
    limit = getattr(config, "recompile_limit", None)
    if limit is None:
        raise _missing("torch", "torch._dynamo.config.recompile_limit",
                       "RegionalCompile warns before a block reaches")  # fmt: skip
    return int(limit)


def cpp_compiler() -> Any:
    """The C++ compiler inductor builds CPU kernels with (``torch._inductor.cpp_builder``);
    raises when there is none."""
    try:
        from torch._inductor import cpp_builder
    except ImportError:
        raise _missing(
            "torch", "torch._inductor.cpp_builder",
            "RegionalCompile asks whether inductor can build CPU kernels",
        ) from None  # fmt: skip
    return cpp_builder.get_cpp_compiler()


def foreach_kernel_devices() -> list[str]:
    """The device types torch has foreach optimizer kernels for."""
    try:
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
    except ImportError:
        raise _missing(
            "torch", "torch.utils._foreach_utils._get_foreach_kernels_supported_devices",
            "FusedOptimizer reads to decide where foreach kernels run",
        ) from None  # fmt: skip
    return list(_get_foreach_kernels_supported_devices())


def qualified_op_name(packet: Any) -> str:
    """An operator packet's ``"namespace::name"`` (``aten::mm``), as torch's own FLOP
    formulas are keyed (``OpOverloadPacket._qualified_op_name``)."""
    try:
        return str(packet._qualified_op_name)
    except AttributeError:
        raise _missing(
            "torch", "torch._ops.OpOverloadPacket._qualified_op_name",
            "count_flops reads to find an operator's FLOP formula",
        ) from None  # fmt: skip


def autograd_running() -> bool:
    """Whether autograd is running a backward pass in this thread now."""
    task = _private(
        torch._C, "_current_graph_task_id", "torch", "torch._C._current_graph_task_id",
        "count_flops reads to tell backward operators from forward ones",
    )  # fmt: skip
    return bool(task() != -1)


def current_autograd_node() -> Any:
    """The autograd node whose backward is running now (None outside backward)."""
    node = _private(
        torch._C, "_current_autograd_node", "torch", "torch._C._current_autograd_node",
        "count_flops reads to credit a backward operator to the module that made its node",
    )  # fmt: skip
    return node()


def autograd_sequence_nr() -> int:
    """The sequence number the next autograd node made in this thread will get."""
    number = _private(
        torch._C._autograd, "_get_sequence_nr", "torch", "torch._C._autograd._get_sequence_nr",
        "count_flops reads to tell the nodes a module call made from older ones",
    )  # fmt: skip
    return int(number())


def node_sequence_nr(node: Any) -> int:
    """An autograd node's sequence number (the order nodes were made in, per thread)."""
    number = _private(
        node, "_sequence_nr", "torch", "torch.autograd.graph.Node._sequence_nr",
        "count_flops reads to tell the nodes a module call made from older ones",
    )  # fmt: skip
    return int(number())
