"""ActivationCheckpointing: recompute the model's repeated blocks in backward, no model code."""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_speedkit import _compat, _surgery, _validation
from lightning_speedkit._blocks import (
    CacheOff,
    block_candidates,
    block_instances,
    repeated_block_types,
)
from lightning_speedkit._model_ready import forget_pending, when_model_ready
from lightning_speedkit.distributed._replayed_state import CallState

__all__ = [
    "ActivationCheckpointing",
    "checkpoint_blocks",
    "checkpointed_blocks",
    "saved_tensor_bytes",
    "uncheckpoint_blocks",
]

BlockChoice = str | Sequence[type[nn.Module] | str]


def _checkpointed(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # What the block runs is read at each call: an attention swap installed in the block
    # after it was wrapped (found by tracing at its first call) runs inside the checkpoint,
    # and the recomputation runs the forward this call ran.
    forward = _surgery.wrapped_forward(module)
    if (
        not (module.training and torch.is_grad_enabled())
        or _surgery.wrappers_paused()
        or not _gradient_passes(module, args, kwargs)
    ):
        # Nothing is kept for backward anyway (a frozen block on frozen inputs: compiled,
        # a checkpoint there is an inference graph, whose recomputation pass refuses
        # dropout's random numbers); or the call is traced for attention, which may be
        # swapped at its end: its recomputation would run the swap.
        return forward(*args, **kwargs)
    if torch.compiler.is_compiling():
        # Compiled, the recomputation is part of the backward graph, traced from this
        # forward, and buffer updates are applied once, after the graph (dynamo takes no
        # context managers of ours here).
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    # What the recomputation must see: the block's buffers and counters as this forward
    # finds them. An enclosing swap's setting for its call (a Hugging Face model's
    # attention implementation) is gone when backward recomputes: replayed around it.
    state = CallState(module)
    contexts = partial(_contexts, state, _surgery.call_settings())
    output = checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)
    state.learn()
    return output


def _gradient_passes(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether backward reaches this call: a parameter of the block, or a tensor it is given
    (inside tuples, lists and dicts too: rotary ``position_embeddings``), requires grad."""
    if any(p.requires_grad for p in module.parameters()):
        return True
    tree_flatten, _ = _compat.tree_flatten_and_map()
    given = tree_flatten((args, kwargs))[0]
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in given)


def _contexts(
    state: CallState, settings: tuple[_surgery.Setting, ...]
) -> tuple[contextlib.AbstractContextManager[None], Any]:
    """Checkpoint's (forward, recomputation) contexts: the forward as it is; the
    recomputation under the enclosing swaps' settings the forward ran in, on the block's
    buffers and counters as the forward found them, which it leaves as they were."""
    return contextlib.nullcontext(), _recomputation(state, settings)


@contextlib.contextmanager
def _recomputation(state: CallState, settings: tuple[_surgery.Setting, ...]) -> Iterator[None]:
    with _surgery.replayed(settings), state.replayed():
        yield


def _check_model(model: Any, function: str) -> nn.Module:
    fix = f"pass the model (or LightningModule) itself to `{function}`, not its name or a path"
    checked: nn.Module = _validation.instance(
        "model", model, nn.Module, what="a torch.nn.Module", fix=fix
    )
    return checked


def _check_fraction(fraction: Any) -> float:
    return _validation.probability("fraction", fraction, low_open=True, example=0.5)


def _import_class(path: str) -> type[nn.Module]:
    module_name, _, attribute = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        _validation.fail(
            "blocks", path, "names a class that cannot be imported",
            f"give an importable `module.Class` path or the class itself ({type(exc).__name__}: "
            f"{exc})",
        )  # fmt: skip
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        fix = "give the class of the model's blocks (e.g. a transformer layer)"
        _validation.fail("blocks", path, "names something that is not an nn.Module class", fix)
    return found


_BLOCKS = 'must be "auto" or a list of module classes (or class names)'


def _check_blocks(blocks: Any) -> list[type[nn.Module] | str] | None:
    """What can be known of ``blocks`` without the model; None means ``"auto"``.

    Classes and dotted ``module.Class`` paths are resolved now; plain class names are
    looked up in the model when it is there (:func:`_resolve`).
    """
    if isinstance(blocks, str):
        if blocks == "auto":
            return None
        fix = f"to name one class, pass a list: `blocks=[{blocks!r}]`"
        _validation.fail("blocks", blocks, _BLOCKS, fix)
    if isinstance(blocks, type) and issubclass(blocks, nn.Module):
        _validation.fail("blocks", blocks, "must be a list of module classes",
                         f"pass `blocks=[{blocks.__name__}]`")  # fmt: skip
    if not isinstance(blocks, (list, tuple, set, frozenset)):
        _validation.fail("blocks", blocks, _BLOCKS,
                         "pass e.g. `blocks=[MyBlock]` or `blocks=['MyBlock']`")  # fmt: skip
    if not blocks:
        _validation.fail("blocks", blocks, "names no block (nothing would be checkpointed)",
                         'pass `blocks="auto"` or at least one module class')  # fmt: skip
    checked: list[type[nn.Module] | str] = []
    for block in blocks:
        if isinstance(block, type) and issubclass(block, nn.Module):
            checked.append(block)
        elif isinstance(block, str) and "." in block:
            checked.append(_import_class(block))
        elif isinstance(block, str) and block.isidentifier():
            checked.append(block)
        else:
            _validation.fail("blocks", block, "holds an entry that is not a module class",
                             "give module classes or names, e.g. `blocks=[MyBlock]` or "
                             "`blocks=['MyBlock']`")  # fmt: skip
    return checked


def _resolve(model: nn.Module, blocks: list[type[nn.Module] | str] | None) -> list[type[nn.Module]]:
    if blocks is None:
        return repeated_block_types(model, shared=True)
    present = [type(m) for m in model.modules()]
    kinds: list[type[nn.Module]] = []
    for block in blocks:
        if isinstance(block, str):
            named = [kind for kind in dict.fromkeys(present) if kind.__name__ == block]
            if not named:
                _validation.fail("blocks", block, "is not a module class of this model",
                                 _offer(model))  # fmt: skip
            kinds += named
        else:
            kinds.append(block)
    if not any(kind in kinds for kind in present):
        _validation.fail("blocks", [kind.__name__ for kind in kinds],
                         "holds no module class of this model", _offer(model))  # fmt: skip
    return kinds


def _offer(model: nn.Module) -> str:
    found = [kind.__name__ for kind in repeated_block_types(model, shared=True)]
    if found:
        return f'its repeated blocks are {", ".join(found)}; name those, or pass "auto"'
    names = [kind.__name__ for kind in dict.fromkeys(type(m) for m in model.modules())]
    return f"it has no repeated blocks; its module classes are {', '.join(names[:12])}"


def _none_found(model: nn.Module) -> str:
    """What to pass when ``"auto"`` finds no block: a layer held once and called in a loop
    (ALBERT's) is not seen without running the model; the likeliest class comes first."""
    candidates = [kind.__name__ for kind in block_candidates(model)[:10]]
    why = (
        f"ActivationCheckpointing: no repeated blocks found in {type(model).__name__} (a "
        f"block class held at least twice by one ModuleList or Sequential, or one layer "
        f"listed several times); nothing checkpointed."
    )
    if not candidates:
        return (
            f"{why} Its layers hold no modules of their own, so there is no block to "
            f"checkpoint: remove ActivationCheckpointing."
        )
    return (
        f"{why} A layer held once and called in a loop (ALBERT's) is not found: name its "
        f"class, `blocks=[{candidates[0]}]` (classes that can be blocks here: "
        f"{', '.join(candidates)})."
    )


def checkpoint_blocks(
    model: nn.Module, blocks: BlockChoice = "auto", fraction: float = 1.0
) -> list[str]:
    """Wrap the forward of the model's blocks in non-reentrant activation checkpointing.

    A checkpointed block keeps only its inputs for backward and runs its forward again
    there: activation memory of those blocks falls to their inputs (Korthikanti et al.
    2022: ``2 s b h`` bytes per transformer layer instead of ``s b h (34 + 5 a s / h)``)
    for one more forward of them (about a third more compute per step). Outputs and
    gradients are unchanged (dropout's random state is replayed), as are the state_dict
    keys and the optimizer's parameters: only each block instance's ``forward`` changes.
    The recomputation runs on the block's buffers and plain Python counters as its
    forward found them, and leaves them as the forward left them: batch norm's running
    statistics, a counter, an MoE load buffer or a reassigned running mean
    (``self.mean = 0.9 * self.mean + ...``) are updated once per step, as without
    checkpointing (only the buffers a block's forward changes in place are copied, each
    call; which those are is learned at its first call). In eval
    or under ``no_grad`` the blocks run as they are. A Hugging Face model's KV cache
    (``config.use_cache=True``) must be off for training: pass ``use_cache=False`` or
    set ``model.config.use_cache = False`` (the callback does so for the fit). A
    pickled (or ``torch.save``-d) model loads with its blocks still checkpointed. An
    attention swap of a block (:func:`~lightning_speedkit.swap_attention`, before or
    after) runs inside its checkpoint, so the recomputation runs the swapped forward;
    a swap around the blocks (a Hugging Face model's, switched for its call) has its
    setting replayed around the recomputation, which runs after that call. The call
    that traces a model for attention runs its blocks unwrapped, that once.

    Args:
        model: the module, before DDP/FSDP/DeepSpeed wrap it.
        blocks: ``"auto"`` finds the repeated blocks (as ``fsdp_zero2``'s wrap policy
            does: transformer layers, ViT blocks; and one layer listed several times,
            ``nn.ModuleList([layer] * n)``), and warns with what to pass when there is
            none (a layer held once and called in a loop is not found); or a list of
            module classes, class names (``"Block"``, looked up in the model) or import
            paths (``"my_package.model.Block"``, for YAML configs).
        fraction: the share of the blocks to checkpoint, spread evenly over the
            model (1.0: all). Lower it to trade back memory for speed.

    Blocks already checkpointed are left as they are (and not counted again).

    Returns:
        The qualified names of the checkpointed modules.

    Example::

        >>> from torch import nn
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.ff = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        ...     def forward(self, x):
        ...         return x + self.ff(x)
        >>> model = nn.Sequential(*[Block() for _ in range(4)])
        >>> checkpoint_blocks(model, fraction=0.5)
        ['0', '2']
    """
    _check_model(model, "checkpoint_blocks")
    _surgery.refuse_wrapped(model, "checkpoint_blocks")
    fraction = _check_fraction(fraction)
    instances = block_instances(model, _resolve(model, _check_blocks(blocks)))
    if not instances:  # "auto" found nothing (named classes the model lacks are refused)
        rank_zero_warn(_none_found(model))
    chosen = _spread([(name, m) for name, m in instances if not _is_checkpointed(m)], fraction)
    _warn_library_checkpointing(model, [name for name, _ in chosen])
    for _, module in chosen:
        forward = partial(_checkpointed, module)
        forward._speedkit_wrapper = True  # type: ignore[attr-defined]
        _surgery.replace_forward(module, forward)
    return [name for name, _ in chosen]


def _warn_library_checkpointing(model: nn.Module, names: list[str]) -> None:
    """Warn where the model's own library checkpoints layers of these blocks too
    (transformers' ``gradient_checkpointing_enable()``, diffusers'
    ``enable_gradient_checkpointing()``: a module's ``gradient_checkpointing = True``):
    outputs stay exact, but those layers recompute twice in backward, once for each."""
    flagged = [n for n, m in model.named_modules() if vars(m).get("gradient_checkpointing") is True]
    both = [n for n in names if any(_nested(n, f) or _nested(f, n) for f in flagged)]
    if both:
        rank_zero_warn(
            f"ActivationCheckpointing: the model's own gradient checkpointing is on too "
            f"(`gradient_checkpointing = True` on {_few(flagged)}), around or inside "
            f"{len(both)} of its block(s) ({_few(both)}): the layers both checkpoint "
            f"recompute twice in backward, once for each (outputs stay exact). Keep one: "
            f"`model.gradient_checkpointing_disable()` (transformers) or "
            f"`disable_gradient_checkpointing()` (diffusers), or remove ActivationCheckpointing."
        )


def _nested(name: str, outer: str) -> bool:
    """Whether module ``name`` is ``outer`` or inside it (qualified names; "" is the root)."""
    return not outer or name == outer or name.startswith(outer + ".")


def _few(names: list[str]) -> str:
    shown = ", ".join(f"`{n}`" if n else "the model" for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _spread(instances: list[tuple[str, nn.Module]], fraction: float) -> list[tuple[str, nn.Module]]:
    """``fraction`` of ``instances`` (at least one), spread evenly over them."""
    if not instances:
        return []
    count = max(1, math.floor(fraction * len(instances) + 0.5))
    return [instances[math.floor(i * len(instances) / count)] for i in range(count)]


def saved_tensor_bytes(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Bytes autograd keeps for backward while ``fn(*args, **kwargs)`` runs.

    What activation checkpointing saves is measured here, on any device: every tensor
    packed for backward is counted (a tensor saved twice counts twice, as a view of a
    bigger one counts its own size).

    Example::

        >>> import torch
        >>> w = torch.randn(4, 4, requires_grad=True)
        >>> saved_tensor_bytes(lambda x: (x @ w).relu().sum(), torch.randn(8, 4))
        256
    """
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*args, **kwargs)
    return total


def _is_checkpointed(module: nn.Module) -> bool:
    forward = _surgery.wrapper(module)
    return isinstance(forward, partial) and forward.func is _checkpointed


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """The qualified names of the modules :func:`checkpoint_blocks` wrapped in ``model``."""
    _check_model(model, "checkpointed_blocks")
    return [name for name, module in model.named_modules() if _is_checkpointed(module)]


def uncheckpoint_blocks(model: nn.Module) -> list[str]:
    """Undo :func:`checkpoint_blocks`; returns the names restored."""
    _check_model(model, "uncheckpoint_blocks")
    restored = checkpointed_blocks(model)
    for name in restored:
        module = model.get_submodule(name)
        _surgery.restore_forward(module, _surgery.wrapper(module))
    return restored


class ActivationCheckpointing(L.Callback):
    """Runs :func:`checkpoint_blocks` on the LightningModule in ``setup``.

    A LightningModule that builds its layers in ``configure_model`` has its blocks
    checkpointed right after that hook (Lightning calls it after ``setup``). Either way
    before the strategy wraps the model, so it works the same under DDP, the ZeRO-2
    presets and DeepSpeed: each wrapped unit sees a block whose forward recomputes in
    backward. The blocks checkpointed are printed (rank 0). Each ``fit`` checkpoints what
    its callback's ``blocks`` and ``fraction`` choose: a later ``fit`` of the same module
    with the same choice keeps its blocks as they are (wrapped once); one whose choice
    differs (another callback, or another Trainer, with other settings) first restores
    the blocks checkpointed before, by an earlier fit or by :func:`checkpoint_blocks`,
    and says so. A ``fit`` of another module checkpoints that one's blocks. After the
    fit the blocks stay checkpointed (which changes nothing in eval or under
    ``no_grad``); :func:`uncheckpoint_blocks` restores them.

    A Hugging Face model's ``config.use_cache`` (True by default: a KV cache built at
    every call, in training too) is turned off around the checkpointed blocks for the
    fit, and turned back on at its end (or when it fails): the recomputation in
    backward would read back what the forward stored in the cache (T5's cross-attention
    keys and values, and backward fails) or append to it a second time (GPT-2, Llama),
    and the cache would hold its tensors until backward.

    Args:
        blocks: ``"auto"`` (the model's repeated blocks) or a list of module classes,
            class names or import paths (see :func:`checkpoint_blocks`). What can be
            checked without the model is checked here; class names are looked up in
            ``setup``.
        fraction: share of the blocks to checkpoint, spread evenly (default all).
        verbose: print what was checkpointed.

    Example::

        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[ActivationCheckpointing(fraction=0.5)], logger=False)
    """

    def __init__(
        self, blocks: BlockChoice = "auto", fraction: float = 1.0, *, verbose: bool = True
    ) -> None:
        self._blocks = _check_blocks(blocks)
        self.blocks = blocks
        self.fraction = _check_fraction(fraction)
        self.verbose = _validation.boolean("verbose", verbose)
        self.checkpointed: list[str] = []
        """The blocks checkpointed in the module of the latest ``fit``."""
        self._cache_off = CacheOff()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # a module that builds its blocks in configure_model: after it
            when_model_ready(pl_module, partial(self._checkpoint, pl_module))

    def _checkpoint(self, pl_module: L.LightningModule) -> None:
        # What these settings choose in this module, whatever is checkpointed now.
        instances = block_instances(pl_module, _resolve(pl_module, self._blocks))
        wanted = [name for name, _ in _spread(instances, self.fraction)]
        already = checkpointed_blocks(pl_module)
        kept = already == wanted  # a later fit() with the same choice: left as they are
        undone: list[str] = []
        if kept:
            self.checkpointed = already
        else:
            undone = uncheckpoint_blocks(pl_module)  # an earlier fit's (other) choice
            blocks = "auto" if self._blocks is None else self._blocks
            self.checkpointed = checkpoint_blocks(pl_module, blocks, self.fraction)
        if not instances and kept:  # "auto" found no block (else checkpoint_blocks said so)
            rank_zero_warn(_none_found(pl_module))
        holders = self._cache_off.turn_off(pl_module, self.checkpointed)
        if not self.verbose:
            return
        if undone:
            rank_zero_info(
                f"ActivationCheckpointing: restored {len(undone)} block(s) checkpointed "
                f"before with another choice (an earlier fit's or `checkpoint_blocks`'); this "
                f"fit checkpoints what its `blocks` and `fraction` choose"
            )
        if self.checkpointed and not kept:
            kinds = sorted({type(pl_module.get_submodule(n)).__name__ for n in self.checkpointed})
            rank_zero_info(
                f"ActivationCheckpointing: {len(self.checkpointed)} blocks "
                f"({', '.join(kinds)}) recompute their activations in backward"
            )
        if holders:
            rank_zero_info(
                f"ActivationCheckpointing: `config.use_cache` off for the fit on {holders}, "
                f"restored at its end: the recomputation in backward would read back or "
                f"append to a KV cache, which the loss does not use"
            )

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        forget_pending(pl_module)
        self._cache_off.restore()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        forget_pending(pl_module)  # a fit that failed before configure_model
        self._cache_off.restore()
