"""Which module each counted operator belongs to, and the per-module table of a count.

:class:`Owners` gives each operator one owner (forward: the module being called;
backward: the module whose forward created the autograd node being run), so the
modules' FLOPs add up; :func:`top_level` turns FLOPs per module path into the table
:attr:`~lightning_speedkit.measure.flops.FlopCount.by_module` shows.
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from lightning_speedkit import _compat
from lightning_speedkit.measure._tensor_walk import tensors

#: Key of an autograd node's ``metadata``: the module paths whose forward created it.
_OWNER = "lightning_speedkit.owner"


def _metadata(node: Any) -> dict[str, Any]:
    """An autograd node's ``metadata`` dict (a property; torch's stub says a method)."""
    metadata: dict[str, Any] = node.metadata
    return metadata


class Owners:
    """Which module owns each operator: the module whose forward runs it, or, in backward,
    the module whose forward created the autograd node being run.

    Forward: a stack of the modules being called (global forward hooks), innermost
    last. Backward: when a module's forward returns, every autograd node its call
    created and its outputs reach, not yet claimed by a module inside it, is labelled
    with the stack (the node's ``metadata``); the backward operators of that node go
    to those modules. One owner per operator, so the modules' FLOPs add up. (torch's
    ``ModuleTracker`` keeps a set of the modules whose backward has begun and not
    ended, which during backward holds siblings at once: two branches were both
    credited with each other's backward.)
    """

    def __init__(self) -> None:
        self._stack: list[tuple[str, int]] = []  # (path, sequence number at its call)
        self._names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._seen: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._handles: list[Any] = []

    @property
    def is_bw(self) -> bool:
        """Whether autograd is running a backward pass now."""
        return _compat.autograd_running()

    def _node_owner(self) -> tuple[str, ...]:
        """Owner of the autograd node running now; () outside backward or when unknown."""
        if not self.is_bw:
            return ()
        node = _compat.current_autograd_node()
        return _metadata(node).get(_OWNER, ()) if node is not None else ()

    def _owner(self) -> tuple[str, ...]:
        # A forward run inside backward (a checkpoint's recomputation) belongs below the
        # modules that owned the node being run, whose own calls are over.
        return (*self._node_owner(), *(path for path, _ in self._stack))

    def paths(self) -> tuple[str, ...]:
        """The owning module and its callers, outermost first (``Global`` always), each
        once: a module that calls itself (recursion, a checkpoint's recomputation under
        the node's owner) is credited once per operator."""
        if self.is_bw and not torch.is_grad_enabled():
            return tuple(dict.fromkeys(("Global", *self._node_owner())))
        return tuple(dict.fromkeys(("Global", *self._owner())))

    def _name(self, module: torch.nn.Module) -> str:
        # As torch's ModuleTracker names them: the first module seen by its class, and
        # its descendants by attribute path below it.
        name = self._names.get(module)
        if name is None:
            name = self._names[module] = type(module).__name__
        if module not in self._seen:
            self._seen.add(module)
            for child_name, child in module.named_children():
                self._names[child] = f"{name}.{child_name}"
                self._name(child)
        return name

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        self._stack.append((self._name(module), _compat.autograd_sequence_nr()))

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._stack:
            return
        owner = self._owner()
        _, start = self._stack.pop()
        # Nodes this call created have sequence numbers from `start` on (the counter is
        # per thread, and a forward runs on one); older nodes are the inputs' history.
        # (`requires_grad` first: reading a tensor's `grad_fn` can make a lazy tensor
        # subclass, as AttentionSwap's traced placeholders, compute itself.)
        todo = [t.grad_fn for t in tensors(output) if t.requires_grad]
        seen: dict[int, Any] = {}  # holds the nodes, so that their ids stay theirs
        while todo:
            node = todo.pop()
            if node is None or id(node) in seen or _compat.node_sequence_nr(node) < start:
                continue
            seen[id(node)] = node
            _metadata(node).setdefault(_OWNER, owner)  # a module inside got there first
            todo.extend(next_node for next_node, _ in node.next_functions)

    def __enter__(self) -> Owners:
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack.clear()


def _children(by_path: dict[str, int], node: str) -> dict[str, int]:
    """FLOPs of ``node``'s direct children, by name.

    A container (``nn.ModuleList``, ``nn.ModuleDict``) is never called, so it has no
    entry of its own: its FLOPs are those of its shallowest called descendants (a
    nanoGPT's ``transformer`` ModuleDict gathers ``wte``, ``h.0``..``h.11``, ``ln_f``).
    """
    prefix = node + "."
    below = {p[len(prefix) :]: f for p, f in by_path.items() if p.startswith(prefix)}
    children: dict[str, int] = defaultdict(int)
    for path, flops in below.items():
        parts = path.split(".")
        if any(".".join(parts[:depth]) in below for depth in range(1, len(parts))):
            continue  # counted in a called ancestor below the node
        children[parts[0]] += flops
    return dict(children)


def top_level(by_path: dict[str, int]) -> dict[str, int]:
    """Children of the first node that does not hand (nearly) all its FLOPs to one child."""
    roots = {p: f for p, f in by_path.items() if p != "Global" and "." not in p}
    if len(roots) != 1:
        return dict(sorted(roots.items(), key=lambda kv: -kv[1]))
    ((node, total),) = roots.items()
    while True:
        children = _children(by_path, node)
        if len(children) == 1 and math.isclose(next(iter(children.values())), total, rel_tol=0.01):
            ((name, total),) = children.items()
            node = f"{node}.{name}"
            continue
        rest = total - sum(children.values())
        if rest > 0:
            children["(own operators)"] = rest
        return dict(sorted(children.items(), key=lambda kv: -kv[1]))
