"""The Trainer-free core of :class:`~lightning_speedkit.RegionalCompile`: which blocks,
and ``nn.Module.compile`` of each in place (:func:`compile_blocks`).

See :mod:`lightning_speedkit.compute.regional_compile` for why blocks, and why in place.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_speedkit import _compat, _surgery, _validation
from lightning_speedkit._blocks import block_instances, repeated_block_types
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = [
    "CACHE_CALLED",
    "BlockChoice",
    "CompileMode",
    "check_backend_name",
    "check_options",
    "compile_blocks",
    "compiled_blocks",
    "cpu_compiler_missing",
]

# The name these records had before the core moved here: a logging setup keeps working.
log = logging.getLogger("lightning_speedkit.compute.regional_compile")

BlockChoice = str | Sequence[type[nn.Module] | str]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


# --- choosing and compiling the blocks ---------------------------------------------------------


def check_options(
    mode: Any, dynamic: Any, fullgraph: Any, backend: Any, blocks: Any = "auto"
) -> None:
    """Refuse bad ``compile_blocks``/``RegionalCompile`` arguments, naming the argument."""
    _validation.choice("mode", mode, (None, *_MODES), hint="None (torch's default) to start")
    _validation.choice("dynamic", dynamic, (None, True, False),
                       hint="None lets dynamo decide after a shape changes")  # fmt: skip
    _validation.boolean("fullgraph", fullgraph)
    if not (isinstance(backend, str) or callable(backend)):
        _validation.fail("backend", backend, "must be a backend name or a callable backend",
                         'pass e.g. `backend="inductor"`')  # fmt: skip
    if isinstance(blocks, str):
        if blocks != "auto":
            _validation.fail("blocks", blocks,
                             'must be "auto" or a list of module classes (or class names)',
                             f"to name one class, pass a list: `blocks=[{blocks!r}]`")  # fmt: skip
    elif not isinstance(blocks, (list, tuple)) or not all(
        isinstance(b, str) or (isinstance(b, type) and issubclass(b, nn.Module)) for b in blocks
    ):
        _validation.fail("blocks", blocks,
                         'must be "auto" or a list of module classes (or class names)',
                         "pass e.g. `blocks=[MyBlock]` or `blocks=['MyBlock']`")  # fmt: skip


def check_backend_name(backend: Any) -> None:
    if not isinstance(backend, str) or backend in torch.compiler.list_backends(exclude_tags=()):
        return
    _validation.choice("backend", backend, sorted(torch.compiler.list_backends()),
                       why="is not a torch.compile backend",
                       hint='"inductor" is the one that generates faster code')  # fmt: skip


def _resolve(model: nn.Module, blocks: BlockChoice) -> list[type[nn.Module]]:
    if isinstance(blocks, str):
        return repeated_block_types(model)
    present = list(dict.fromkeys(type(m) for m in model.modules()))
    kinds: list[type[nn.Module]] = []
    for block in blocks:
        if isinstance(block, str):
            named = [kind for kind in present if kind.__name__ == block]
            if not named:
                names = ", ".join(kind.__name__ for kind in present[:12])
                fix = f'its classes are {names}; name one of those, or pass "auto"'
                _validation.fail("blocks", block, "names no module class of this model", fix)
            kinds += named
        else:
            kinds.append(block)
    return kinds


def _is_compiled(module: nn.Module) -> bool:
    return _compat.compiled_call_impl(module) is not None


def _refuse_compiled_around(model: nn.Module, instances: list[tuple[str, nn.Module]]) -> None:
    """Raise if the model, or a module around one of ``instances``, is compiled already.

    A block compiled inside a region that ``torch.compile`` already traces would be
    compiled twice over: the outer compiled frame takes the block's compiled call apart
    (dynamo fails on it, or recompiles it call after call). A block that is itself
    compiled in place (an earlier ``compile_blocks``) is not refused: it is left as it is.
    """
    if _compat.compiled_by_lightning(model):
        raise SpeedkitConfigError(
            "`compile_blocks` (which RegionalCompile runs) got a LightningModule whose steps "
            "Lightning already compiles, because it was passed as `torch.compile(model)`: its "
            "blocks would be compiled again inside the compiled step. Either pass the module "
            "uncompiled (`trainer.fit(model)`) and let RegionalCompile compile its repeated "
            "blocks, or keep `torch.compile(model)` and remove RegionalCompile."
        )
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, block in instances:
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            around = ".".join(parts[:depth])
            module = modules.get(around, model)
            wrapped = type(module).__name__ == "OptimizedModule"  # torch.compile(module)
            in_place = module is not block and _is_compiled(module)  # module.compile()
            if not (wrapped or in_place):
                continue
            what = "" if around == name else " in the model" if not around else f" in `{around}`"
            how = "torch.compile(...)" if wrapped else "module.compile()"
            raise SpeedkitConfigError(
                f"`compile_blocks` (which RegionalCompile runs) found the block `{name}`"
                f"{what}, which is compiled already ({how}): compiled again inside that "
                f"compiled region, the block would recompile or fail. Either remove that "
                f"compile and let RegionalCompile compile the repeated blocks, or name blocks "
                f"outside it (`blocks=[...]`), or remove RegionalCompile and keep your compile."
            )


def compiled_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` compiled in place (``nn.Module.compile``)."""
    return [name for name, module in model.named_modules() if _is_compiled(module)]


#: Compiled blocks that were called with a KV cache among their arguments (a
#: ``DynamicCache`` and the like): the likely cause of their recompiling, one graph per layer.
CACHE_CALLED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _carries_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a block's call carries a KV cache object (transformers' ``*Cache`` classes)."""
    return any(type(value).__name__.endswith("Cache") for value in (*args, *kwargs.values()))


def _note_cache(module: nn.Module) -> None:
    """Record a block called with a KV cache; the first of its class (among live modules)
    warns, as it happens: every other layer is about to compile a graph of its own."""
    first = not any(type(other) is type(module) for other in CACHE_CALLED)
    CACHE_CALLED.add(module)
    if first:
        rank_zero_warn(
            f"RegionalCompile: a compiled {type(module).__name__} is called with a KV cache "
            f"(`past_key_values`); each layer reads its own slot of it, so each layer compiles "
            f"a graph of its own, and past dynamo's limit (8) the rest run uncompiled. Training "
            f"needs no cache: set `model.config.use_cache = False` or pass `use_cache=False` "
            f"(the RegionalCompile callback turns `config.use_cache` off for the fit)."
        )


def cpu_compiler_missing(backend: Any) -> str | None:
    """Why inductor cannot build CPU kernels here, or None when it can."""
    if backend != "inductor":
        return None
    try:
        _compat.cpp_compiler()
    except Exception as exc:  # torch raises its own error types here, which move between versions
        return f"inductor builds CPU kernels with a C++ compiler, and none was found ({exc})"
    return None


def compile_blocks(
    model: nn.Module,
    blocks: BlockChoice = "auto",
    *,
    mode: CompileMode | None = None,
    dynamic: bool | None = None,
    fullgraph: bool = False,
    backend: str | Callable[..., Any] = "inductor",
) -> list[str]:
    """Compile every instance of the model's repeated block classes in place.

    Each block gets ``module.compile(...)`` (``torch.compile`` of its call, kept on the
    module): parameters, buffers and ``state_dict`` keys stay as they were. Instances
    of one class share their compiled code, so the compile time is about one block's
    per class. Compilation itself happens at each block's first call. A block that
    is already compiled is left as it is, so calling this twice is harmless. A block
    whose forward is torch's own (``nn.TransformerEncoderLayer``,
    ``nn.TransformerDecoderLayer``), which ``module.compile()`` alone leaves uncompiled,
    gets a ``forward`` of the kit's on the instance that calls it from a frame dynamo
    compiles (:func:`_traced_forward`).

    Other kit techniques that change a block's forward (activation checkpointing,
    attention swap) may run before or after: the compiled call runs whatever forward
    the block has when it is first called. While a TorchDispatchMode is active (a
    FLOP count, :func:`~lightning_speedkit.count_flops`), the blocks run eagerly, so
    that it sees every operator.

    A block nested inside another one found is not compiled apart (the outer one's
    graph holds it). The first call of a block that carries a KV cache (Hugging Face
    decoders build one by default, ``config.use_cache=True``) warns: each layer reads
    its own slot of it, so each layer compiles a graph of its own; set
    ``model.config.use_cache = False`` for training (:class:`RegionalCompile` does so
    for the fit).

    Args:
        model: the module, before DDP/FSDP/DeepSpeed wrap it.
        blocks: ``"auto"`` (the repeated blocks, as ``ActivationCheckpointing`` and
            ``fsdp_zero2`` find them) or a list of module classes or class names.
        mode: ``torch.compile``'s mode. None (torch's default) compiles fastest;
            ``"max-autotune"`` searches kernels for longer, for long runs on GPUs.
        dynamic: None lets dynamo compile for the first shape and, when a shape
            changes, once more with that dimension symbolic; True starts symbolic
            (variable-length batches); False compiles every new shape anew (each one
            counts against dynamo's recompile limit, after which the block runs eagerly).
        fullgraph: raise at compile time if a block does not compile into a single
            graph (useful to prove nothing breaks the graph).
        backend: ``"inductor"`` (generates kernels; on CPU it needs a C++ compiler),
            or any ``torch.compile`` backend (``"aot_eager"`` traces without
            generating code: a quick check that a block compiles at all).

    Returns:
        The qualified names of the compiled modules, in model order.

    Example::

        >>> from torch import nn
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.ff = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        ...     def forward(self, x):
        ...         return x + self.ff(x)
        >>> model = nn.Sequential(nn.Linear(8, 8), *[Block() for _ in range(3)])
        >>> compile_blocks(model, backend="eager")
        ['1', '2', '3']
        >>> list(model.state_dict())[:3]
        ['0.weight', '0.bias', '1.ff.0.weight']
    """
    _validation.instance("model", model, nn.Module, what="a torch.nn.Module",
                         fix="pass the model itself, e.g. `compile_blocks(model)`")  # fmt: skip
    check_options(mode, dynamic, fullgraph, backend, blocks)
    _surgery.refuse_wrapped(model, "compile_blocks")
    check_backend_name(backend)
    kinds = _resolve(model, blocks)
    instances = block_instances(model, kinds)
    _refuse_compiled_around(model, instances)
    options: dict[str, Any] = {"dynamic": dynamic, "fullgraph": fullgraph, "backend": backend}
    if mode is not None:
        options["mode"] = mode
    for _, module in instances:
        if not _is_compiled(module):
            _compile_in_place(module, options)
    return [name for name, _ in instances]


def _traced_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A block's own class forward, called from a frame that dynamo compiles.

    ``module.compile()`` compiles ``Module._call_impl``, and dynamo compiles no frame
    whose code is torch's own: it skips ``_call_impl`` (which runs the hooks, eagerly)
    and, as a rule, compiles the first frame below it, the block's ``forward``. When that
    forward is torch's too (``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer``,
    or a subclass that keeps their forward), it skips that as well, and nothing is
    compiled: pytorch/pytorch#150915. ``torch.compile(module)`` avoids this by calling
    such a module from a frame of its own; this function is that frame for a block
    compiled in place. The module comes as an argument, not in a closure: dynamo guards
    on its class and attributes, not on which instance it is, so every block of the
    class shares one graph.
    """
    return type(module).forward(module, *args, **kwargs)


def _runs_torch_forward(module: nn.Module) -> bool:
    """Whether ``module(...)`` runs a forward from torch's own code (see
    :func:`_traced_forward`): its class's, with no forward put on the instance (the
    kit's wrappers and swaps put theirs, whose frames dynamo compiles)."""
    forward = getattr(type(module), "forward", None)
    home = str(getattr(forward, "__module__", ""))
    return "forward" not in vars(module) and home.partition(".")[0] == "torch"


def _compile_in_place(module: nn.Module, options: dict[str, Any]) -> None:
    """``module.compile(**options)``, with the block run eagerly under a dispatch mode.

    A block that runs torch's own forward gets ``partial(_traced_forward, module)`` as its
    ``forward`` first, on the instance (see :func:`_traced_forward`): it calls the same
    class forward, so outputs, gradients, parameters and ``state_dict`` keys are those of
    the uncompiled block, and its hooks still run eagerly around it. A copy of the block
    (``copy.deepcopy``, pickle) keeps that forward, bound to the copy, and runs eagerly.

    A TorchDispatchMode (the kit's FLOP count) sees every operator only if the block
    runs eagerly: compiled kernels hide the operators they fuse, and dynamo does not
    compile under such a mode anyway (with ``fullgraph=True`` it raises). So while one
    is active, the block's own call runs; otherwise the compiled one. The first compiled
    call that carries a KV cache is noted (:data:`CACHE_CALLED`), to name the cause
    should the block recompile; the calls after it are not looked at (a per-step cost).
    """
    if _runs_torch_forward(module):
        vars(module)["forward"] = partial(_traced_forward, module)
    module.compile(**options)
    compiled, eager = _compat.compiled_and_eager_calls(module)
    ref = weakref.ref(module)  # the module holds this call: no cycle through it
    looked = False

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal looked
        if not torch.compiler.is_compiling():
            if _compat.dispatch_mode_active():
                return eager(*args, **kwargs)
            if not looked:
                looked = True
                held = ref()
                if held is not None and _carries_cache(args, kwargs):
                    _note_cache(held)
        return compiled(*args, **kwargs)

    _compat.set_compiled_call(module, call)
