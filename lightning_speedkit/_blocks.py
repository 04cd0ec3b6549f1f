"""Find a model's repeated blocks: what FSDP wraps and activation checkpointing recomputes."""

from __future__ import annotations

from collections import Counter

from torch import nn

__all__ = ["block_instances", "repeated_block_types"]


#: torch's generic containers: a model's structure, never a block of its own. A
#: ``Sequential`` of ``Sequential`` layers would otherwise make "every Sequential" the block
#: class, the model itself included.
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def repeated_block_types(model: nn.Module) -> list[type[nn.Module]]:
    """Classes of the model's repeated blocks, outermost first found.

    A block class has child modules (not a single layer), holds parameters, and
    appears at least twice among the children of one ``nn.ModuleList`` or
    ``nn.Sequential`` (transformer layers, ViT blocks, ResNet stages). torch's generic
    containers themselves (``Sequential``, ``ModuleList``, ``ModuleDict``; not a class
    derived from one) are never block classes. A class whose every instance sits inside
    a block of another found class is left out: wrapping the outer block covers it.

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
        kinds = Counter(
            type(child)
            for child in container.children()
            if type(child) not in _CONTAINERS
            and next(child.children(), None) is not None
            and _has_parameters(child)
        )
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
