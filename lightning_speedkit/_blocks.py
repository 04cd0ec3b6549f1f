"""Find a model's repeated blocks: what FSDP wraps and activation checkpointing recomputes."""

from __future__ import annotations

from collections import Counter

from torch import nn

__all__ = ["block_instances", "repeated_block_types"]


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def repeated_block_types(model: nn.Module) -> list[type[nn.Module]]:
    """Classes of the model's repeated blocks, outermost first found.

    A block class has child modules (not a single layer), holds parameters, and
    appears at least twice among the children of one ``nn.ModuleList`` or
    ``nn.Sequential`` (transformer layers, ViT blocks, ResNet stages). A class whose
    every instance sits inside a block of another found class is left out: wrapping
    the outer block covers it.

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
            if next(child.children(), None) is not None and _has_parameters(child)
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
    """``(qualified name, module)`` of every instance of ``kinds``, in model order."""
    wanted = tuple(kinds)
    return [(name, m) for name, m in model.named_modules() if type(m) in wanted]
