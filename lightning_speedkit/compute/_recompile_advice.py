"""Why a compiled block keeps recompiling, and the fix: the text of RegionalCompile's warning.

:func:`recompile_advice` is a pure function of what
:class:`~lightning_speedkit.compute.CompileWatch` counted, dynamo's last recompile reason,
dynamo's recompile limit, the ``dynamic`` setting, whether the blocks were called with a KV
cache, which block class the recompiling function belongs to (:func:`recompiling_block`:
its instances and their parameter shapes) and whether the recompilations all came in the
first training step. :func:`warn_at` is when the callback warns; the callback only reads
the counters and says the text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from lightning_speedkit import _compat

if TYPE_CHECKING:
    from lightning_speedkit.measure._compile_watch import CompileWatch

__all__ = ["Recompiling", "recompile_advice", "recompile_warning", "recompiling_block", "warn_at"]

#: What dynamo's guard failures say when a tensor's shape changed (``tensor 'x' size
#: mismatch at index 1``; with symbolic sizes, a failed ``L['x'].size()[1]`` relation).
_SHAPE_GUARDS = ("size mismatch", "stride mismatch", "rank mismatch", ".size()", ".stride()")


def _is_shape_guard(reason: str) -> bool:
    return any(marker in reason for marker in _SHAPE_GUARDS)


def _one_line(reason: str) -> str:
    """A guard failure on one line, cut at 200 characters."""
    text = " ".join(reason.split())
    return text if len(text) <= 200 else text[:197] + "..."


def warn_at(recompile_warning: int, classes: int, limit: int) -> int:
    """Recompilations of one function at which RegionalCompile warns.

    ``recompile_warning`` beyond one compilation per block class (blocks whose forward the
    kit replaced share one function, which dynamo compiles once per class), but at most
    ``limit - 1``: dynamo keeps at most ``limit`` graphs of a function
    (``torch._dynamo.config.recompile_limit``), so its recompilations stop at ``limit - 1``
    and a higher threshold never fires, while the calls that fit none of the graphs run
    uncompiled.

    Example::

        >>> warn_at(4, 1, 8), warn_at(4, 5, 8), warn_at(4, 1, 3)
        (4, 7, 2)
    """
    return max(1, min(recompile_warning + classes - 1, limit - 1))


@dataclass(frozen=True)
class Recompiling:
    """The block class whose forward is the function that recompiled most."""

    kind: str
    """The class's name."""
    instances: int
    """Its compiled instances (its instances inside compiled blocks, if it is not one)."""
    parameter_shapes: int
    """Distinct parameter shapes among them: each needs a graph of its own."""
    others: tuple[str, ...]
    """The other compiled block classes, to name in ``blocks=[...]`` instead."""


def _codes(module: nn.Module) -> set[tuple[str, int]]:
    """``(file, first line)`` of the module's forward, and of each function it wraps."""
    forward = getattr(module, "forward", None)
    found, function = set(), getattr(forward, "__func__", forward)
    while function is not None and hasattr(function, "__code__"):
        found.add((function.__code__.co_filename, function.__code__.co_firstlineno))
        function = getattr(function, "__wrapped__", None)
    return found


def recompiling_block(
    blocks: Sequence[nn.Module], code: tuple[str, int] | None
) -> Recompiling | None:
    """The one class among ``blocks`` (or the modules inside them) whose forward is the
    function at ``code`` (file, first line); None when none or several are."""
    if code is None:
        return None
    kinds = {type(block) for block in blocks}
    inside = {id(m): m for block in blocks for m in block.modules()}.values()
    owners = {type(m) for m in inside if code in _codes(m)}
    owners = (owners & kinds) or owners  # a compiled block's own forward before a nested one's
    if len(owners) != 1:
        return None
    (kind,) = owners
    instances = [b for b in blocks if type(b) is kind] or [m for m in inside if type(m) is kind]
    shapes = {tuple((n, tuple(p.shape)) for n, p in m.named_parameters()) for m in instances}
    # the classes to name instead; none when the class is only inside the compiled blocks
    others = tuple(sorted(o.__name__ for o in kinds - {kind})) if kind in kinds else ()
    return Recompiling(kind.__name__, len(instances), len(shapes), others)


def _frame_code(frame: str) -> tuple[str, int] | None:
    """``(file, first line)`` of the function dynamo compiled as frame ``frame``, from its
    latest compilation dynamo still records."""
    found = [(file, line) for compile_id, file, line in _compat.dynamo_compiled_code()
             if compile_id.lstrip("!").rpartition("/")[0] == frame]  # fmt: skip
    return found[-1] if found else None


def recompile_warning(
    watch: CompileWatch,
    blocks: Sequence[nn.Module],
    *,
    cache_called: bool,
    dynamic: bool | None,
    first_step: Mapping[str, int],
    limit: int,
) -> str:
    """:func:`recompile_advice` for the function ``watch`` saw recompile most, among the
    compiled ``blocks``; ``first_step`` is ``watch.by_frame`` after the first training step."""
    frame = max(watch.by_frame, key=watch.by_frame.__getitem__)
    return recompile_advice(
        watch.most_recompiled, watch.recompiles, watch.seconds, watch.last_reason(),
        cache_called=cache_called, dynamic=dynamic, limit=limit,
        block=recompiling_block(blocks, _frame_code(frame)),
        first_step=watch.by_frame[frame] <= first_step.get(frame, 0),
    )  # fmt: skip


def _limit_text(most_recompiled: int, limit: int) -> str:
    if most_recompiled + 1 >= limit:  # the function holds as many graphs as dynamo keeps
        return (
            f"it now holds {limit} graphs, dynamo's limit per function "
            f"(`torch._dynamo.config.recompile_limit`): from now on its calls that fit none of "
            f"them run uncompiled (instances not compiled yet, a new shape)"
        )
    return f"past dynamo's limit ({limit}) it runs uncompiled"


def _parameter_shapes_text(said: str, block: Recompiling, limit_text: str, limit: int) -> str:
    raise_to = 2 * block.parameter_shapes  # a shape compiled static, then symbolic when it changes
    more = (
        f"Let dynamo keep more graphs, one or two per parameter shape: "
        f"`torch._dynamo.config.recompile_limit = {raise_to}` before the fit"
        if raise_to > limit
        else f"dynamo's limit ({limit}) has room for one or two graphs per parameter shape"
    )
    leave_out = (
        f"`RegionalCompile(blocks=[{', '.join(block.others)}])` leaves {block.kind} out"
        if block.others
        else f"name a class that holds the {block.kind} blocks in `RegionalCompile(blocks=[...])`"
    )
    return (
        f"{said}: its {block.instances} instances have {block.parameter_shapes} different "
        f"parameter shapes (channel counts that change with the place in the network), and "
        f"dynamo compiles a graph for each: it keeps parameter shapes static, so neither "
        f"`dynamic=True` nor fewer batch shapes helps; {limit_text}. {more}; or compile only "
        f"blocks whose instances share their shapes: {leave_out}."
    )


def recompile_advice(
    most_recompiled: int,
    recompiles: int,
    seconds: float,
    reason: str | None,
    *,
    cache_called: bool,
    dynamic: bool | None,
    limit: int = 8,
    block: Recompiling | None = None,
    first_step: bool = False,
) -> str:
    """The warning for a block that recompiled ``most_recompiled`` times: the likely cause, the fix.

    The cause is decided in this order: a KV cache among the blocks' arguments (each layer
    reads its own slot of it); instances of the block class with different parameter shapes
    (a UNet's channel counts; dynamo keeps parameter shapes static, so each shape is a graph
    of its own); ``dynamic=True`` already set (so not a changing length); no reason recorded
    by dynamo; a reason that is not a guard on a tensor's shape (a Python value that changes
    between calls); shapes that changed only within the first step (inputs whose shape
    depends on the instance's place in the network); else changing batch shapes.

    Args:
        most_recompiled: recompilations of the function that recompiled most.
        recompiles: recompilations counted in all.
        seconds: time spent compiling so far.
        reason: dynamo's last reason for that function's recompiling, None if unknown.
        cache_called: whether a compiled block was called with a KV cache.
        dynamic: the ``dynamic`` the blocks were compiled with.
        limit: dynamo's ``recompile_limit``, the most graphs it keeps of one function.
        block: the block class that function belongs to, None if unknown.
        first_step: whether all its recompilations came in the first training step.

    Example::

        >>> advice = recompile_advice(4, 4, 2.5, "tensor 'x' size mismatch at index 1",
        ...                           cache_called=False, dynamic=None)
        >>> "batch shapes keep changing" in advice, "`RegionalCompile(dynamic=True)`" in advice
        (True, True)
    """
    who = "a compiled block" if block is None else f"{block.kind}'s compiled forward"
    said = (
        f"RegionalCompile: {who} recompiled {most_recompiled} times "
        f"({recompiles} recompilations, {seconds:.1f} s compiling so far)"
    )
    limit_text = _limit_text(most_recompiled, limit)
    quoted = "" if reason is None else f" (dynamo's last reason: `{_one_line(reason)}`)"
    if cache_called:
        return (
            f"{said}: its calls carry a KV cache (`past_key_values`), and each layer "
            f"reads its own slot of it, so each layer compiles a graph of its own; "
            f"{limit_text}. Training needs no cache: pass `use_cache=False` to the model, or "
            f"set `model.config.use_cache = False` (changing shapes are not the cause, "
            f"and `dynamic=True` would not help)."
        )
    shape_or_unknown = reason is None or _is_shape_guard(reason)
    if block is not None and block.parameter_shapes > 1 and shape_or_unknown:
        return _parameter_shapes_text(f"{said}{quoted}", block, limit_text, limit)
    return _other_causes(said, quoted, reason, limit_text, dynamic=dynamic, first_step=first_step)


def _other_causes(
    said: str,
    quoted: str,
    reason: str | None,
    limit: str,
    *,
    dynamic: bool | None,
    first_step: bool,
) -> str:
    """The advice when neither a KV cache nor parameter shapes are the cause."""
    if dynamic is True:
        return (
            f"{said}{quoted}, with `dynamic=True` already set, so not because a length "
            f"changes; {limit}. Run with `TORCH_LOGS=recompiles` to see the guard that "
            f"fails (a Python number, flag or module attribute that differs between calls; "
            f"a dimension of size 0 or 1, which dynamo specializes)."
        )
    if reason is None:
        return (
            f"{said}; {limit}. dynamo's reason could not be read: `TORCH_LOGS=recompiles` "
            f"shows the guard that fails. For a tensor's shape, compile with "
            f"`RegionalCompile(dynamic=True)` or give batches fewer distinct shapes (length "
            f"bucketing, sequence packing); for any other value (a Python number or flag, a "
            f"module attribute, train/eval or grad mode), keep it fixed during training."
        )
    if not _is_shape_guard(reason):
        return (
            f"{said}, not because a shape changes: dynamo's last reason is "
            f"`{_one_line(reason)}`; {limit}. That guard is on a value that differs between "
            f"calls (a Python number, string or flag, a module attribute, train/eval or "
            f"grad mode): keep it fixed during training, or pass it as a tensor. "
            f"`TORCH_LOGS=recompiles` lists every guard that fails."
        )
    if first_step:
        return (
            f"{said}{quoted}: all within the first step, so not because batch shapes change: "
            f"its instances get inputs of different shapes by their place in the network "
            f"(a UNet's resolutions); {limit}. Compile for symbolic shapes with "
            f"`RegionalCompile(dynamic=True)`: one graph then serves them all. Length "
            f"bucketing or sequence packing would not help."
        )
    return (
        f"{said}{quoted}: batch shapes keep changing; {limit}. Compile for "
        f"symbolic shapes with `RegionalCompile(dynamic=True)`, or give batches fewer "
        f"distinct shapes: length bucketing or sequence packing (SpeedDataModuleMixin's "
        f"`lengths=` or PackingCollate). `TORCH_LOGS=recompiles` shows the guard that fails."
    )
