"""Every place the kit reads something torch or Lightning does not offer publicly, in one module.

Private names (a leading underscore, reached from torch, Lightning or DeepSpeed) are read
here and nowhere else in the package; tests/test_compat.py scans the package to keep it so,
and checks that every name read here resolves on the installed versions. A name gone from
an installed version raises an error that says which, and which feature needs it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, cast

import lightning as L
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


def log_every_n_steps(trainer: L.Trainer) -> int:
    """The Trainer's ``log_every_n_steps`` (set at runtime by its logger connector)."""
    value = getattr(trainer, "log_every_n_steps", 50)
    return int(value)


def train_loader_source(trainer: L.Trainer) -> Any:
    """Where the fit loop will request its train loader (Lightning's ``_DataLoaderSource``).

    It has ``dataloader()`` (calls the DataModule's or LightningModule's hook, or returns
    the loader passed to ``fit``), and ``instance``/``name``, which decide what is called.
    """
    return trainer.fit_loop._data_source


class _ChangedTrainSource:
    """The fit loop's train-loader source with a callback's change to every loader it gives.

    Stands in for Lightning's ``_DataLoaderSource`` (``dataloader()``, ``is_defined()``,
    ``is_module()``, ``instance``, ``name``) in front of the one it replaced (``inner``),
    so a loader the loop requests later (``reload_dataloaders_every_n_epochs``, or a
    callback's own reload) still comes from the user's hook, and is changed as the
    first was. The loader the tuner built is served at the first request; each later
    request calls the inner source, as Lightning's own would. ``instance`` is the inner
    source's, and setting it (Lightning does, when ``fit`` attaches its data) sets the
    inner one's.
    """

    def __init__(self, inner: Any, owner: str, change: Callable[[Any], Any]) -> None:
        self.inner, self.owner, self.change = inner, owner, change
        self._next: Any = None  # served at the next request

    @property
    def instance(self) -> Any:
        return self.inner.instance

    @instance.setter
    def instance(self, value: Any) -> None:
        self.inner.instance = value

    @property
    def name(self) -> str:
        return str(self.inner.name)

    def is_defined(self) -> bool:
        return bool(self.inner.is_defined())

    def is_module(self) -> bool:
        return bool(self.inner.is_module())

    def dataloader(self) -> Any:
        if self._next is not None:
            loader, self._next = self._next, None
            return loader
        return self.change(self.inner.dataloader())


def change_train_loader(
    trainer: L.Trainer,
    owner: str,
    change: Callable[[Any], Any],
    loader: Any = None,
    *,
    before_loop: bool = False,
) -> None:
    """Make the fit loop train on ``loader``, and on ``change(new)`` for every loader it
    requests later.

    ``owner`` (a callback's name) names the change: a second call by the same owner
    replaces its change rather than adding one, and :func:`drop_train_loader_change`
    takes it out. Changes by different owners compose, the later applied last.
    ``loader`` None: the next request already goes through ``change``.

    ``before_loop`` (a callback's ``on_fit_start``, before the fit loop runs): a loader
    the loop has already built is dropped, with its fetcher, so that it builds
    ``loader``. Reading ``trainer.estimated_stepping_batches`` in ``configure_optimizers``
    (warm-up and OneCycle schedules) builds the train loader that early. Later, the
    loader being iterated stays until the loop reloads (see
    :func:`reload_train_loader_next_epoch`).
    """
    loop = trainer.fit_loop
    source = loop._data_source
    mine: Any = source
    while isinstance(mine, _ChangedTrainSource) and mine.owner != owner:
        mine = mine.inner
    if not isinstance(mine, _ChangedTrainSource):
        mine = _ChangedTrainSource(source, owner, change)
        loop._data_source = mine  # a stand-in for Lightning's
    mine.change, mine._next = change, loader
    if before_loop and loop._combined_loader is not None:
        if loop._data_fetcher is not None:
            loop._data_fetcher.teardown()  # its iterator may hold worker processes
            loop._data_fetcher = None
        loop._combined_loader = None


def drop_train_loader_change(trainer: L.Trainer, owner: str) -> None:
    """Take ``owner``'s change (:func:`change_train_loader`) out of the fit loop's source.

    Call it when the fit ends, and before a new fit sets its own: the loaders Lightning
    requests then are the user's again.
    """
    loop = trainer.fit_loop
    above: Any = None
    source = loop._data_source
    while isinstance(source, _ChangedTrainSource):
        if source.owner == owner:
            if above is None:
                loop._data_source = source.inner
            else:
                above.inner = source.inner
            return
        above, source = source, source.inner


def train_combined_loader(trainer: L.Trainer) -> Any:
    """The fit loop's CombinedLoader (Lightning wraps every train loader, or dict or list
    of loaders, in one); None before the loop has built it."""
    return trainer.fit_loop._combined_loader


def combined_loader_mode(loader: Any) -> str:
    """A CombinedLoader's mode: ``"max_size_cycle"``, ``"min_size"``, ``"max_size"`` or
    ``"sequential"`` (only its constructor takes it; nothing reads it back publicly)."""
    return str(loader._mode)


def dataloader_built_again(loader: Any, changes: dict[str, Any]) -> Any | None:
    """``loader``'s own class constructed again from its own arguments, but ``changes``.

    The arguments are those Lightning records for a loader made in a ``*_dataloader``
    hook (``__pl_saved_args``); for a loader made elsewhere, the attributes named as
    the constructor's parameters, and only when every parameter the class adds to
    DataLoader's is kept under its own name. The new loader is made the way a hook's
    is, so that Lightning can build it again around a ``DistributedSampler`` too.

    None when the arguments cannot be recovered, the class refuses them, or the loader
    it makes does not have exactly ``changes`` (a subclass that transforms an argument,
    ``batch_size * 2``): the caller then builds a torch DataLoader.
    """
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from torch.utils.data import BatchSampler, DataLoader

    cls = type(loader)
    parameters = inspect.signature(cls.__init__).parameters
    named = {n: p for n, p in list(parameters.items())[1:]
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}  # fmt: skip
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    if hasattr(loader, "__pl_saved_args"):
        args = tuple(getattr(loader, "__pl_saved_args"))
        names = tuple(getattr(loader, "__pl_saved_arg_names"))
        if len(args) != len(names):  # positional arguments that cannot be named
            return None
        kwargs = {**dict(zip(names, args, strict=True)), **getattr(loader, "__pl_saved_kwargs")}
    else:
        own = set(named) - set(inspect.signature(DataLoader.__init__).parameters)
        kept = vars(loader)
        if not own <= set(kept):  # an argument of the subclass's that it keeps nowhere
            return None
        readable = {"multiprocessing_context": loader.multiprocessing_context, **kept}
        kwargs = {n: readable[n] for n in named if n in readable}
    kwargs.update(changes)
    if not takes_any and not set(kwargs) <= set(named):
        return None
    if any(p.default is p.empty and n not in kwargs for n, p in named.items()):
        return None
    try:
        with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
            again = cls(**kwargs)
    except (TypeError, ValueError):
        return None
    placeholders = {"batch_size", "drop_last"} if changes.get("batch_sampler") else set()
    for key, value in changes.items():
        if key == "shuffle" or key in placeholders or (value is None and key in _MADE_WHEN_NONE):
            continue  # the sampler tells `shuffle`, the batch sampler the batch size; defaults
        made = getattr(again, key, None)
        if made is not value and made != value:
            return None
    return again


#: DataLoader arguments that, given as None, the loader fills in itself.
_MADE_WHEN_NONE = frozenset({"sampler", "batch_sampler", "prefetch_factor"})


def metric_state(metric: Any) -> dict[str, Any]:
    """A torchmetrics ``Metric``'s accumulated state (what ``add_state`` declared) and the
    caches its ``update`` and ``compute`` keep, by attribute name: ``setattr`` each back
    to put the metric where it was."""
    names = [*metric._defaults, "_update_count", "_computed", "_forward_cache"]
    return {name: getattr(metric, name) for name in names if hasattr(metric, name)}


def reload_train_loader_next_epoch(trainer: L.Trainer) -> Callable[[], None]:
    """Make the fit loop request its train loader again when the next epoch starts.

    Through Lightning's own switch, the Trainer's ``reload_dataloaders_every_n_epochs``
    (which its stubs do not declare), set to 1 until the returned function puts the
    user's value back: call that once the next epoch has started
    (``on_train_epoch_start``, after the loop has reloaded). Call this after the
    epoch's validation (``on_train_epoch_end``), or the validation loaders reload too.
    """
    before = getattr(trainer, "reload_dataloaders_every_n_epochs", 0)
    trainer.reload_dataloaders_every_n_epochs = 1  # type: ignore[attr-defined]

    def restore() -> None:
        trainer.reload_dataloaders_every_n_epochs = before  # type: ignore[attr-defined]

    return restore


def datamodule(trainer: L.Trainer) -> Any:
    """The Trainer's DataModule or None (a property Lightning's stubs do not declare)."""
    return getattr(trainer, "datamodule", None)


def add_callback_once(trainer: L.Trainer, callback: L.Callback) -> None:
    """Append ``callback`` to the Trainer's callbacks unless one of its type is there.

    Strategies use it from ``setup_environment``, which Lightning runs before it
    restores callback state from a checkpoint.
    """
    callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    if not any(type(c) is type(callback) for c in callbacks):
        callbacks.append(callback)


def take_over_accumulation(
    trainer: L.Trainer,
    window_done: Callable[[], bool],
    window_starts: Callable[[], bool],
) -> Callable[[], None]:
    """Let the caller decide where gradient-accumulation windows start and end.

    Lightning decides both with ``batch_idx % accumulate_grad_batches`` counted from the
    start of each epoch, so a factor changed mid-epoch puts a window's edges in the wrong
    places (stale gradients carried into the next step). Two methods decide:

    - ``_TrainingEpochLoop._accumulated_batches_reached()``: "does this batch close a
      window" (everything else -- ``_should_accumulate``, DDP's ``no_sync``, checkpoint
      and logger step counting -- derives from it);
    - ``_AutomaticOptimization._make_zero_grad_fn(batch_idx, optimizer)``: "does this
      batch open one" (zero the gradients first).

    Both are replaced on the loop instances; ``accumulate_grad_batches`` keeps its other
    job, the loss divisor. Returns the function that puts Lightning's own back.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    automatic = epoch_loop.automatic_optimization
    for owner, name in ((epoch_loop, "_accumulated_batches_reached"),
                        (automatic, "_make_zero_grad_fn")):  # fmt: skip
        if not callable(getattr(owner, name, None)):
            raise RuntimeError(
                f"This Lightning ({L.__version__}) has no `{type(owner).__name__}.{name}`, which "
                f"AccumulationScheduler drives. It is tested with Lightning 2.x up to 2.6; "
                f"please report the version."
            )
    lightning_zero_grad_fn = automatic._make_zero_grad_fn

    def make_zero_grad_fn(batch_idx: int, optimizer: Any) -> Callable[[], None] | None:
        if not window_starts():
            return None
        divisor = trainer.accumulate_grad_batches
        trainer.accumulate_grad_batches = 1  # Lightning's own check then says "zero now"
        try:
            return lightning_zero_grad_fn(batch_idx, optimizer)
        finally:
            trainer.accumulate_grad_batches = divisor

    epoch_loop._accumulated_batches_reached = window_done  # type: ignore[method-assign]
    automatic._make_zero_grad_fn = make_zero_grad_fn  # type: ignore[method-assign]

    def restore() -> None:
        epoch_loop.__dict__.pop("_accumulated_batches_reached", None)
        automatic.__dict__.pop("_make_zero_grad_fn", None)

    return restore


def default_process_group_store() -> Any:
    """The rendezvous store of torch.distributed's default process group; None without one.

    torch keeps it private (``distributed_c10d._get_default_store``); HangWatchdog talks
    to the other ranks through it, outside every collective.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_store is None:
        raise RuntimeError(
            f"This torch ({torch.__version__}) has no "
            f"`torch.distributed.distributed_c10d._get_default_store`, which HangWatchdog "
            f"uses to reach the other ranks. It is tested with torch 2.x up to 2.13; please "
            f"report the version, and remove HangWatchdog from the Trainer meanwhile."
        )
    return get_store()


def torch_profiler_enabled() -> bool:
    """Whether a torch.profiler session is running in this process (torch has one per
    process; a second profiler must not start or stop it)."""
    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    if enabled is None:
        raise RuntimeError(
            f"This torch ({torch.__version__}) has no `torch.autograd._profiler_enabled`, which "
            f"ProfilerSchedule reads to stand down beside another profiler. Please report the "
            f"version."
        )
    return bool(enabled())


def has_compiled_parts(model: Any) -> bool:
    """Whether ``model`` holds modules that ``torch.compile`` compiles at their first call:
    compiled in place (``nn.Module.compile``, the kit's RegionalCompile) or wrapped
    (``torch.compile(module)``, an ``OptimizedModule``)."""
    optimized = getattr(torch._dynamo.eval_frame, "OptimizedModule", ())
    return any(
        getattr(module, "_compiled_call_impl", None) is not None or isinstance(module, optimized)
        for module in model.modules()
    )


# --- torch and Lightning names the kit's other modules need --------------------------------------
#
# Each function below reads one private name. Where the name is gone from the installed
# torch or Lightning, it raises the error _missing builds: the version, the name, and the
# feature that needs it. tests/test_compat.py lists every private name read here and checks
# that each one resolves on the installed versions.


def _missing(library: Literal["torch", "Lightning"], name: str, feature: str) -> RuntimeError:
    version = torch.__version__ if library == "torch" else L.__version__
    return RuntimeError(
        f"This {library} ({version}) has no `{name}`, which {feature}. The kit is tested "
        f"with torch 2.x up to 2.13 and Lightning 2.x up to 2.6; please report the version."
    )


def _private(owner: Any, attribute: str, library: Literal["torch", "Lightning"], name: str,
             feature: str) -> Any:  # fmt: skip
    """``owner.attribute``, or the error that names the version, ``name`` and ``feature``."""
    value = getattr(owner, attribute, None)
    if value is None:
        raise _missing(library, name, feature)
    return value


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


# --- attention/ and data/ -----------------------------------------------------------------------

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_always_called",
)


def hook_dicts(
    module: Any,
) -> tuple[dict[int, Any], dict[int, Any], dict[int, Any], dict[int, Any]]:
    """``module``'s forward-hook dicts: pre-hooks, which of them take kwargs, hooks, which
    of them always run. The traced family's discovery fills them with one shared handle's
    id for each probed module (a handle per module would cost a registration each)."""
    found = [getattr(module, name, None) for name in _HOOK_DICTS]
    for name, value in zip(_HOOK_DICTS, found, strict=True):
        if value is None:
            raise _missing("torch", f"nn.Module.{name}", "AttentionSwap's discovery fills")
    pre, pre_kwargs, post, always = found
    return pre, pre_kwargs, post, always  # type: ignore[return-value]


def mha_same_embed_dim(module: Any) -> bool:
    """Whether an ``nn.MultiheadAttention`` takes keys and values of the query's size."""
    same = _private(
        module, "_qkv_same_embed_dim", "torch", "nn.MultiheadAttention._qkv_same_embed_dim",
        "AttentionSwap reads to build an example input for a MultiheadAttention",
    )  # fmt: skip
    return bool(same)


def loader_iterator_workers(iterator: Any) -> tuple[list[Any], Callable[[], None] | None]:
    """A DataLoader iterator's worker processes and its orderly shutdown: the worker search
    ends a failed candidate's workers itself. An in-process iterator has neither."""
    return list(getattr(iterator, "_workers", [])), getattr(iterator, "_shutdown_workers", None)


def is_dataloader_iterator(iterator: Any) -> bool:
    """Whether ``iterator`` is a torch DataLoader's (``_BaseDataLoaderIter``)."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    return isinstance(iterator, _BaseDataLoaderIter)


def take_sampler_iterator(iterator: Any) -> Any:
    """A running DataLoader iterator's sampler iterator (``_sampler_iter``: the batches of
    indices of the epoch not handed out yet), taken from it: the iterator then delivers
    only what its workers already hold (see :func:`is_dataloader_iterator`).
    NumWorkersTuner switches a loader's workers mid-epoch with it."""
    taken = _private(
        iterator, "_sampler_iter", "torch", "torch.utils.data.dataloader._BaseDataLoaderIter"
        "._sampler_iter", "NumWorkersTuner takes the rest of an epoch's order from",
    )  # fmt: skip
    iterator._sampler_iter = iter(())
    return taken


def train_loader_running(trainer: L.Trainer) -> tuple[Any, Any] | None:
    """The fit loop's one train loader and its iterator of the epoch under way (what
    ``CombinedLoader`` iterates, ``CombinedLoader._iterator.iterators``); None when
    there is no epoch under way or the loop trains on several loaders."""
    combined = trainer.fit_loop._combined_loader
    if combined is None or len(combined.flattened) != 1:
        return None
    iterators = getattr(getattr(combined, "_iterator", None), "iterators", None)
    if not isinstance(iterators, list) or len(iterators) != 1:
        return None
    return combined.flattened[0], iterators[0]


def continue_train_epoch(trainer: L.Trainer, loader: Any, iterator: Any) -> None:
    """Make the fit loop take the rest of this epoch's batches from ``iterator`` and
    iterate ``loader`` from the next epoch on, in place of the one loader
    :func:`train_loader_running` gave. ``loader`` must have that loader's length: the
    loop counted the epoch's batches from it."""
    combined: Any = trainer.fit_loop._combined_loader
    combined._iterator.iterators[0] = iterator
    combined.flattened = [loader]  # what trainer.train_dataloader gives, and the next epoch


def tree_flatten_and_map() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """torch's pytree ``tree_flatten`` and ``tree_map`` (``torch.utils._pytree``)."""
    try:
        from torch.utils._pytree import tree_flatten, tree_map
    except ImportError as error:
        raise _missing("torch", "torch.utils._pytree", "AttentionSwap's tracer uses") from error
    return tree_flatten, tree_map


def make_wrapper_subclass(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``torch.Tensor._make_wrapper_subclass``: a tensor subclass instance with no storage
    (the tracer's placeholders)."""
    make = _private(
        torch.Tensor, "_make_wrapper_subclass", "torch", "torch.Tensor._make_wrapper_subclass",
        "AttentionSwap's tracer uses",
    )  # fmt: skip
    return make(cls, *args, **kwargs)


def disable_torch_function_subclass() -> Any:
    """A context in which tensor subclasses' ``__torch_function__`` is not called."""
    disable = _private(
        torch._C, "DisableTorchFunctionSubclass", "torch", "torch._C.DisableTorchFunctionSubclass",
        "AttentionSwap's tracer uses",
    )  # fmt: skip
    return disable()


def tensor_version(tensor: Any) -> int:
    """How many times ``tensor`` was written in place (``Tensor._version``): the
    frozen-feature cache reads it each step to know, without touching the data, whether
    a cached module's weights may have changed."""
    version = getattr(tensor, "_version", None)
    if version is None:
        raise _missing("torch", "Tensor._version", "FrozenFeatureCache reads to see weights change")
    return int(version)
