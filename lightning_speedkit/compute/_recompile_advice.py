"""Why a compiled block keeps recompiling, and the fix: the text of RegionalCompile's warning.

A pure function of what :class:`~lightning_speedkit.compute.CompileWatch` counted, dynamo's
last recompile reason, whether the blocks were called with a KV cache, and the ``dynamic``
setting: the callback only decides when to warn.
"""

from __future__ import annotations

__all__ = ["recompile_advice"]

#: What dynamo's guard failures say when a tensor's shape changed (``tensor 'x' size
#: mismatch at index 1``; with symbolic sizes, a failed ``L['x'].size()[1]`` relation).
_SHAPE_GUARDS = ("size mismatch", "stride mismatch", "rank mismatch", ".size()", ".stride()")


def _is_shape_guard(reason: str) -> bool:
    return any(marker in reason for marker in _SHAPE_GUARDS)


def _one_line(reason: str) -> str:
    """A guard failure on one line, cut at 200 characters."""
    text = " ".join(reason.split())
    return text if len(text) <= 200 else text[:197] + "..."


def recompile_advice(
    most_recompiled: int,
    recompiles: int,
    seconds: float,
    reason: str | None,
    *,
    cache_called: bool,
    dynamic: bool | None,
) -> str:
    """The warning for a block that recompiled ``most_recompiled`` times: the likely cause, the fix.

    The cause is decided in this order: a KV cache among the blocks' arguments (each layer
    reads its own slot of it); ``dynamic=True`` already set (so not a changing length);
    no reason recorded by dynamo; a reason that is not a guard on a tensor's shape (a
    Python value that changes between calls); else changing batch shapes.

    Args:
        most_recompiled: recompilations of the frame that recompiled most.
        recompiles: recompilations counted in all.
        seconds: time spent compiling so far.
        reason: dynamo's last reason for that frame's recompiling, None if unknown.
        cache_called: whether a compiled block was called with a KV cache.
        dynamic: the ``dynamic`` the blocks were compiled with.

    Example::

        >>> advice = recompile_advice(4, 4, 2.5, "tensor 'x' size mismatch at index 1",
        ...                           cache_called=False, dynamic=None)
        >>> "batch shapes keep changing" in advice, "`RegionalCompile(dynamic=True)`" in advice
        (True, True)
    """
    said = (
        f"RegionalCompile: a compiled block recompiled {most_recompiled} times "
        f"({recompiles} recompilations, {seconds:.1f} s compiling so far)"
    )
    limit = "past dynamo's limit (8) it runs uncompiled"
    quoted = "" if reason is None else f" (dynamo's last reason: `{_one_line(reason)}`)"
    if cache_called:
        return (
            f"{said}: its calls carry a KV cache (`past_key_values`), and each layer "
            f"reads its own slot of it, so each layer compiles a graph of its own; "
            f"{limit}. Training needs no cache: pass `use_cache=False` to the model, or "
            f"set `model.config.use_cache = False` (changing shapes are not the cause, "
            f"and `dynamic=True` would not help)."
        )
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
    return (
        f"{said}{quoted}: batch shapes keep changing; {limit}. Compile for "
        f"symbolic shapes with `RegionalCompile(dynamic=True)`, or give batches fewer "
        f"distinct shapes: length bucketing or sequence packing (SpeedDataModuleMixin's "
        f"`lengths=` or PackingCollate). `TORCH_LOGS=recompiles` shows the guard that fails."
    )
