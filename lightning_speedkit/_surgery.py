"""The one place where the kit changes a user's modules.

Techniques that change how a module runs (attention swap, activation
checkpointing) go through here: they replace a module's ``forward`` on the
instance, never its parameters or buffers, so state_dict keys, the optimizer's
parameter references and checkpoints of the unchanged model all stay valid, and
:func:`restore_forward` undoes it exactly.

The replacement is kept in an attribute, and ``module.forward`` becomes the module's
bound method of one function, the same for every module, that calls it: so
torch.compile traces all instances of a block class into one graph. (With a
per-instance callable as ``forward``, a ``functools.partial`` included, dynamo guards
on its identity and compiles once per instance, and past its recompile limit of 8
blocks not at all.)

Two of the kit's forwards can share a module: a wrapper (activation checkpointing)
and one that replaces its computation (an attention swap). The wrapper is always the
outer one, whichever was applied first, and reads the forward it runs at each call,
so a checkpoint recomputes in backward exactly what its forward ran (see
:func:`replace_forward`). A forward of the kit that encloses other modules and holds a
setting for the duration of its call (a Hugging Face swap: the model's attention
implementation and the SDPA kernel) declares it with :func:`call_setting`; a
checkpoint taken inside replays it around its recomputation (:func:`replayed`), which
runs in backward, after that call has returned.

Pickle stores a bound method as ``getattr(module, "_call_replaced")``, which no module
has, so a pickled model (or ``torch.save(model)``) saved but did not load. The kit's
bound methods are registered with copyreg and multiprocessing's pickler to pickle as
the module, which the loading side binds again; a module's class ``forward`` bound to
it (a swap's reference to the module's own forward) pickles as that, where
``getattr(module, "forward")`` would give the kit's; any other bound method is
reduced exactly as pickle does. Everything else the kit puts on a module is made of
module-level functions and plain objects, never lambdas or closures. A model loaded
from a pickle keeps the kit's forwards as they were (checkpointed blocks stay
checkpointed, swapped attention stays swapped), as ``copy.deepcopy`` does.
"""

from __future__ import annotations

import contextlib
import copyreg
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch import nn

from lightning_speedkit.errors import SpeedkitConfigError

#: Instance attribute holding a forward that the module had before ours (rare: another tool's).
_PREVIOUS = "_speedkit_previous_forward"
#: Instance attribute holding the kit's outermost forward, which ``module.forward`` calls.
_REPLACED = "_speedkit_forward"
#: Instance attribute holding, under a wrapper, the kit's forward the wrapper runs.
_WRAPPED = "_speedkit_wrapped_forward"


def _call_replaced(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module.forward`` while the kit has replaced it (the same function for every module)."""
    return getattr(self, _REPLACED)(*args, **kwargs)


def _bound(module: nn.Module) -> Callable[..., Any]:
    """``module.forward`` while the kit has replaced it, for ``module``."""
    return types.MethodType(_call_replaced, module)


def _class_forward(module: nn.Module) -> Callable[..., Any]:
    """``module``'s class forward, bound to it (what a swap runs as the module's own)."""
    bound: Callable[..., Any] = type(module).forward.__get__(module)
    return bound


def _reduce_method(method: types.MethodType) -> tuple[Any, ...]:
    """Pickle a bound method: the kit's as its module, a module's class forward as that
    (``getattr(module, "forward")`` gives the kit's once the module is loaded), any other
    as pickle does."""
    owner = method.__self__
    if method.__func__ is _call_replaced:
        return _bound, (owner,)
    if isinstance(owner, nn.Module) and method.__func__ is getattr(type(owner), "forward", None):
        return _class_forward, (owner,)
    reduced = method.__reduce__()  # exactly what pickle does without this registration
    assert isinstance(reduced, tuple)  # a bound method reduces to (getattr, (self, name))
    return reduced


copyreg.pickle(types.MethodType, _reduce_method)
ForkingPickler.register(types.MethodType, _reduce_method)


def _install(module: nn.Module, forward: Callable[..., Any]) -> None:
    module.__dict__[_REPLACED] = forward
    module.__dict__["forward"] = _bound(module)


def _uninstall(module: nn.Module) -> None:
    """The module's forward as it was before the kit (another tool's, or its class's)."""
    module.__dict__.pop(_REPLACED, None)
    module.__dict__.pop("forward", None)
    if _PREVIOUS in module.__dict__:
        module.__dict__["forward"] = module.__dict__.pop(_PREVIOUS)


_CHANGING = [0]
_FIRST_CALL_WORK = [0]


def note_first_call_work() -> None:
    """The kit did a one-time job inside a module's call (a swap's parity check, attention
    found by tracing): that call is not how later steps run (checkpoints paused, a second
    forward), so a FLOP count of its step would not be either."""
    _FIRST_CALL_WORK[0] += 1


def first_call_work() -> int:
    """How many one-time jobs the kit has done inside module calls, in this process."""
    return _FIRST_CALL_WORK[0]


_SIDE_RUNS = [0]


@contextlib.contextmanager
def side_run() -> Iterator[None]:
    """Around the kit's runs of a module on copies of its inputs, beside the model's own
    call (a swap's parity check and timing): not the training's work, so a frozen-feature
    cache inside neither serves, stores nor counts it (:func:`in_side_run`)."""
    _SIDE_RUNS[0] += 1
    try:
        yield
    finally:
        _SIDE_RUNS[0] -= 1


def in_side_run() -> bool:
    """Whether a :func:`side_run` is running now."""
    return _SIDE_RUNS[0] > 0


_SERVED_FLOPS = [0.0]


def note_served_flops(flops: float) -> None:
    """A module's work was served from a store instead of run (FrozenFeatureCache): the
    FLOPs it would have spent, which a step's FLOP count must not include."""
    _SERVED_FLOPS[0] += flops


def served_flops() -> float:
    """FLOPs served instead of run so far in this process (a step reads the difference)."""
    return _SERVED_FLOPS[0]


@contextlib.contextmanager
def forwards_changing() -> Iterator[None]:
    """Around a call at whose end the kit may replace forwards the call ran (attention found
    by tracing that call). Wrappers run their module's forward unwrapped meanwhile
    (:func:`wrappers_paused`): a checkpoint taken in it would recompute, in backward, the
    forward installed at its end, not the one its forward ran."""
    note_first_call_work()
    _CHANGING[0] += 1
    try:
        yield
    finally:
        _CHANGING[0] -= 1


def wrappers_paused() -> bool:
    """Whether wrappers run their module's forward as it is (see :func:`forwards_changing`)."""
    return _CHANGING[0] > 0


#: What sets up a call's setting and undoes it: a context manager's factory.
Setting = Callable[[], contextlib.AbstractContextManager[Any]]
#: Per thread, the settings of the kit's forwards whose call is running, outermost first.
_SETTINGS = threading.local()


def _settings() -> list[Setting]:
    stack: list[Setting] | None = getattr(_SETTINGS, "stack", None)
    if stack is None:
        stack = _SETTINGS.stack = []
    return stack


@contextlib.contextmanager
def call_setting(setting: Setting) -> Iterator[None]:
    """Run the call inside under ``setting()``, and have the kit's wrappers inside it replay
    ``setting`` around their recomputation (:func:`call_settings`, :func:`replayed`).

    For a forward of the kit that holds a setting over the modules it encloses for its
    call only (a Hugging Face swap switches the model's attention implementation): a
    checkpointed block inside recomputes in backward, after the call, and would run
    without it, another graph (torch's ``CheckpointError``). Compiled, the setting is
    only entered: the recomputation is traced from the forward, in the same graph.
    """
    if torch.compiler.is_compiling():
        with setting():
            yield
        return
    stack = _settings()
    stack.append(setting)
    try:
        with setting():
            yield
    finally:
        stack.pop()


def call_settings() -> tuple[Setting, ...]:
    """The settings of the kit's forwards whose call encloses this one, outermost first."""
    return tuple(_settings())


@contextlib.contextmanager
def replayed(settings: Sequence[Setting]) -> Iterator[None]:
    """Run the code inside under ``settings`` (taken by :func:`call_settings` in the
    forward), outermost first, as the forward ran: a wrapper's recomputation."""
    with contextlib.ExitStack() as stack:
        for setting in settings:
            stack.enter_context(setting())
        yield


def _is_wrapper(forward: Any) -> bool:
    return bool(getattr(forward, "_speedkit_wrapper", False))


def refuse_wrapped(model: nn.Module, what: str) -> None:
    """Raise if ``model`` is already wrapped by a distributed engine or compiled.

    Its modules must be changed before DDP, FSDP or DeepSpeed wrap them (DDP
    captured the parameters and hooks already) or ``torch.compile`` traced them.
    """
    name = type(model).__name__
    wrapped = {
        "DistributedDataParallel": "DDP",
        "FullyShardedDataParallel": "FSDP",
        "DeepSpeedEngine": "DeepSpeed",
        "OptimizedModule": "torch.compile",
    }
    if name in wrapped:
        raise SpeedkitConfigError(
            f"`{what}` got a model already wrapped by {wrapped[name]} ({name}). Apply it to "
            f"the unwrapped module first (`{what}(model.module)` is too late for DDP's hooks): "
            "call it before wrapping, or use its callback, which runs in `setup` before the "
            "strategy wraps the model."
        )


def original_forward(module: nn.Module) -> Callable[..., Any]:
    """The module's forward as it runs without the kit, bound to the module."""
    if _PREVIOUS in module.__dict__:
        previous: Callable[..., Any] = module.__dict__[_PREVIOUS]
        return previous
    if _REPLACED not in module.__dict__ and "forward" in module.__dict__:
        instance: Callable[..., Any] = module.__dict__["forward"]  # another tool's
        return instance
    bound: Callable[..., Any] = type(module).forward.__get__(module)
    return bound


def replace_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    """Make ``module(...)`` call ``forward``; parameters and buffers untouched.

    Two of the kit's forwards can share a module: a *wrapper* (a callable marked
    ``_speedkit_wrapper``, activation checkpointing) and one that replaces the module's
    computation (an attention swap). The wrapper is always the outer one, whichever
    came first: it runs :func:`wrapped_forward`, looked up at each call, so what it
    recomputes in backward is what its forward ran. Any other of the kit's forwards
    on ``module`` is replaced.
    """
    current = module.__dict__.get(_REPLACED)
    if current is None:
        if "forward" in module.__dict__ and _PREVIOUS not in module.__dict__:
            module.__dict__[_PREVIOUS] = module.__dict__["forward"]  # another tool's
        _install(module, forward)
    elif _is_wrapper(forward):
        if not _is_wrapper(current):
            module.__dict__[_WRAPPED] = current  # the swap goes under the wrapper
        _install(module, forward)
    elif _is_wrapper(current):
        module.__dict__[_WRAPPED] = forward
    else:
        _install(module, forward)


def restore_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    """Undo :func:`replace_forward` of ``forward``; the kit's other forward on ``module`` stays."""
    if module.__dict__.get(_WRAPPED) is forward:
        del module.__dict__[_WRAPPED]
    elif module.__dict__.get(_REPLACED) is forward:
        wrapped = module.__dict__.pop(_WRAPPED, None)
        if wrapped is not None:
            _install(module, wrapped)
        else:
            _uninstall(module)


def wrapped_forward(module: nn.Module) -> Callable[..., Any]:
    """What the kit's wrapper on ``module`` runs now: the kit's forward under it, or the
    module's own (read at each call: a swap installed later runs under the wrapper).

    The module's class forward comes as ``partial(type(module).forward, module)``, not
    bound as a method: this runs inside a compiled block's frame, and dynamo names a
    method it binds there by where it would be looked up, ``module.forward``, which is
    the kit's (this wrapper). Where the block's forward breaks the graph (a Hugging Face
    model's output-capturing hooks, asked for hidden states), dynamo calls what it named
    (the wrapper again, and so on until ``RecursionError``). A partial is rebuilt from
    ``type(module).forward``, the class's own.
    """
    wrapped: Callable[..., Any] | None = module.__dict__.get(_WRAPPED)
    if wrapped is not None:
        return wrapped
    if _PREVIOUS in module.__dict__:
        return original_forward(module)  # another tool's forward, kept on the module
    return partial(type(module).forward, module)


def wrapper(module: nn.Module) -> Any:
    """The kit's wrapper on ``module`` (activation checkpointing), or ``None``."""
    forward = module.__dict__.get(_REPLACED)
    return forward if _is_wrapper(forward) else None


def replaced_forward(module: nn.Module) -> Any:
    """The kit's forward that replaces ``module``'s computation (marked ``_speedkit``),
    under any wrapper; ``None`` if there is none."""
    forward = module.__dict__.get(_REPLACED)
    if _is_wrapper(forward):
        forward = module.__dict__.get(_WRAPPED)
    return forward if getattr(forward, "_speedkit", False) else None
