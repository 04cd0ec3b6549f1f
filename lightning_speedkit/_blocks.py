"""Find a model's repeated blocks: what FSDP wraps and activation checkpointing recomputes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = [
    "CacheOff",
    "block_candidates",
    "block_instances",
    "cache_configs",
    "repeated_block_types",
]


#: torch's generic containers: a model's structure, never a block of its own. A
#: ``Sequential`` of ``Sequential`` layers would otherwise make "every Sequential" the block
#: class, the model itself included.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_candidate(module: nn.Module) -> bool:
    """A module that could be a block: it holds modules and parameters, and is not one of
    torch's containers."""
    return (
        type(module) not in _CONTAINERS
        and next(module.children(), None) is not None
        and _has_parameters(module)
    )


def repeated_block_types(model: nn.Module, *, shared: bool = False) -> list[type[nn.Module]]:
    """Classes of the model's repeated blocks, outermost first found.

    A block class has child modules (not a single layer), holds parameters, and
    appears at least twice among the children of one ``nn.ModuleList`` or
    ``nn.Sequential`` (transformer layers, ViT blocks, ResNet stages). torch's generic
    containers themselves (``Sequential``, ``ModuleList``, ``ModuleDict``; not a class
    derived from one) are never block classes. A class whose every instance sits inside
    a block of another found class is left out: wrapping the outer block covers it.

    With ``shared``, one instance listed several times by one container counts each time
    (one layer listed ``n`` times, ``nn.ModuleList([layer] * n)``: its parameters shared):
    what activation checkpointing may wrap (each call of the instance is checkpointed),
    not what FSDP shards (one instance cannot be ``n`` units) nor what ``"auto"`` of
    regional compilation picks. A layer held once and called in a loop (ALBERT's: a
    one-entry ``ModuleList`` called ``num_hidden_layers`` times) is found by neither:
    only running the model would show it; :func:`block_candidates` ranks it first.

    Example::

        >>> from torch import nn
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([Block(), Block()]))
        >>> [t.__name__ for t in repeated_block_types(model)]
        ['Block']
    """
    found: list[type[nn.Module]] = []
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        held = iter(container) if shared else container.children()  # children(): once each
        kinds = Counter(type(child) for child in held if _is_candidate(child))
        found += [kind for kind, n in kinds.items() if n >= 2 and kind not in found]
    outermost: Counter[type[nn.Module]] = Counter()

    def visit(module: nn.Module, inside: bool) -> None:
        is_block = type(module) in found
        if is_block and not inside:
            outermost[type(module)] += 1
        for child in module.children():
            visit(child, inside or is_block)

    visit(model, False)
    return [kind for kind in found if outermost[kind]]


def block_candidates(model: nn.Module) -> list[type[nn.Module]]:
    """Classes to try as ``blocks=[...]`` where :func:`repeated_block_types` finds none,
    the likeliest block first.

    Every module (below the model itself) that holds modules and parameters, torch's
    containers excepted, ranked: first a layer listed more than once (its qualified names
    are several, ``nn.ModuleList([layer] * n)``); then a layer held in an
    ``nn.ModuleList``, innermost first (ALBERT keeps its one layer in a one-entry list,
    inside a one-entry list of layer groups, and calls it in a loop: ``AlbertLayer``
    comes before ``AlbertLayerGroup``); then the rest, outermost first, except that a
    module holding every other candidate (the model's network as a whole, inside a
    LightningModule) comes last. Each class once.

    Example::

        >>> from torch import nn
        >>> class Layer(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.ff = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        >>> class Encoder(nn.Module):  # ALBERT's shape: one layer, called in a loop
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed = nn.Sequential(nn.Embedding(9, 4), nn.LayerNorm(4))
        ...         self.layers = nn.ModuleList([Layer()])
        >>> model = nn.Sequential(Encoder(), nn.Linear(4, 1))
        >>> [kind.__name__ for kind in block_candidates(model)]
        ['Layer', 'Encoder']
    """
    modules = [m for m in model.modules() if m is not model and _is_candidate(m)]
    names = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    lists = [c for c in model.modules() if isinstance(c, nn.ModuleList)]
    listed = {id(m) for m in modules} & {id(m) for c in lists for m in c.children()}
    held = {id(m): {id(d) for d in m.modules() if d is not m} for m in modules}

    def rank(index: int) -> tuple[int, int]:
        module = modules[index]
        if names[id(module)] > 1:
            return 0, index
        if id(module) in listed:  # a list-held layer holding no list-held layer comes first
            return (1 if held[id(module)] & listed else 0) + 1, index
        holds_all = all(id(m) in held[id(module)] for m in modules if m is not module)
        return (4 if holds_all and len(modules) > 1 else 3), index

    order = sorted(range(len(modules)), key=rank)
    return list(dict.fromkeys(type(modules[i]) for i in order))


def block_instances(model: nn.Module, kinds: list[type[nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of the outermost instances of ``kinds``, in model order.

    The model itself is never one of its blocks: its children are searched, whatever
    its class. An instance inside another instance found is left out: what is done to
    a block (compiled, checkpointed, sharded) covers what it holds, and done again
    inside it would nest (a compiled region inside a compiled one, a recomputation
    inside a recomputation). A diffusion UNet whose ``ResnetBlock2D`` appears both inside its
    ``DownBlock`` layers and on its own gives the ``DownBlock`` layers and the lone
    ``ResnetBlock2D``. A module reached by two paths counts once, as in
    ``named_modules``.

    Example::

        >>> from torch import nn
        >>> class Inner(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.ff = nn.Linear(4, 4)
        >>> class Outer(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.inner = Inner()
        >>> model = nn.Sequential(Outer(), Outer(), Inner())
        >>> [name for name, _ in block_instances(model, [Outer, Inner])]
        ['0', '1', '2']
    """
    wanted = tuple(kinds)
    found: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(module: nn.Module, name: str) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if module is not model and type(module) in wanted:
            found.append((name, module))
            return  # what it holds is covered
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    visit(model, "")
    return found


def cache_configs(model: nn.Module, names: Sequence[str]) -> list[tuple[str, Any]]:
    """``(qualified name, config)`` of the modules around the blocks ``names`` whose
    ``config.use_cache`` is True (Hugging Face models: a KV cache built at every call,
    in training too), one per config object."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is not True or id(config) in seen:
            continue
        prefix = f"{name}." if name else ""
        if any(block == name or block.startswith(prefix) for block in names):
            seen.add(id(config))
            found.append((name, config))
    return found


def described(configs: Sequence[tuple[str, Any]], model: nn.Module) -> str:
    """``"T5ForConditionalGeneration (the model), T5Stack (decoder)"``: who holds ``configs``."""
    return ", ".join(
        f"{type(model.get_submodule(name)).__name__} ({name or 'the model'})" for name, _ in configs
    )


class CacheOff:
    """``config.use_cache = False`` around a model's blocks for a while; :meth:`restore`
    turns it back on.

    Training needs no KV cache, and one built in training gets in the way of what the
    kit does to the blocks: each layer reads its own slot of it (so a compiled layer
    compiles apart), and a checkpointed block's recomputation reads back what its
    forward stored there (T5's cross-attention keys and values: the recomputation then
    saves fewer tensors and backward fails) or appends its keys and values a second
    time (GPT-2, Llama), while the cache keeps them alive until backward.

    Example::

        >>> from types import SimpleNamespace
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> model.config = SimpleNamespace(use_cache=True)
        >>> cache = CacheOff()
        >>> cache.turn_off(model, ["0", "1"])
        'Sequential (the model)'
        >>> model.config.use_cache
        False
        >>> cache.restore()
        >>> model.config.use_cache
        True
    """

    def __init__(self) -> None:
        self._configs: list[Any] = []

    def turn_off(self, model: nn.Module, names: Sequence[str]) -> str:
        """Turn the cache off on the configs around the blocks ``names``; returns who holds
        them (as :func:`described`), ``""`` when none had it on."""
        found = cache_configs(model, names)
        for _, config in found:
            config.use_cache = False
        self._configs += [config for _, config in found]
        return described(found, model)

    def restore(self) -> None:
        """Turn the cache back on where :meth:`turn_off` turned it off (once)."""
        for config in self._configs:
            config.use_cache = True
        self._configs = []
