"""ActivationCheckpointing: recompute the model's repeated blocks in backward, no model code."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_speedkit import _surgery
from lightning_speedkit._blocks import block_instances, repeated_block_types
from lightning_speedkit.errors import SpeedkitConfigError

__all__ = [
    "ActivationCheckpointing",
    "checkpoint_blocks",
    "saved_tensor_bytes",
    "uncheckpoint_blocks",
]

BlockChoice = str | Sequence[type[nn.Module] | str]


def _checkpointed(module: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not (module.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)  # nothing is kept for backward anyway
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _check_fraction(fraction: float) -> None:
    if isinstance(fraction, bool) or not 0 < fraction <= 1:
        raise SpeedkitConfigError(f"`fraction` must be in (0, 1], got {fraction!r}.")


def _resolve(model: nn.Module, blocks: BlockChoice) -> list[type[nn.Module]]:
    if isinstance(blocks, str):
        if blocks != "auto":
            raise SpeedkitConfigError(
                f'`blocks` must be "auto" or a list of module classes (or class names), '
                f"got {blocks!r}."
            )
        return repeated_block_types(model)
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    kinds: list[type[nn.Module]] = []
    for block in blocks:
        if isinstance(block, str):
            if block not in by_name:
                raise SpeedkitConfigError(
                    f"`blocks` names {block!r}, which is not a module class of this model."
                )
            kinds.append(by_name[block])
        elif isinstance(block, type) and issubclass(block, nn.Module):
            kinds.append(block)
        else:
            raise SpeedkitConfigError(f"`blocks` holds {block!r}: give module classes or names.")
    return kinds


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
    In eval or under ``no_grad`` the blocks run as they are.

    Args:
        model: the module, before DDP/FSDP/DeepSpeed wrap it.
        blocks: ``"auto"`` finds the repeated blocks (as ``fsdp_zero2``'s wrap policy
            does: transformer layers, ViT blocks); or module classes or class names.
        fraction: the share of the blocks to checkpoint, spread evenly over the
            model (1.0: all). Lower it to trade back memory for speed.

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
    _surgery.refuse_wrapped(model, "checkpoint_blocks")
    _check_fraction(fraction)
    instances = block_instances(model, _resolve(model, blocks))
    if not instances:
        return []
    count = max(1, math.floor(fraction * len(instances) + 0.5))
    chosen = [instances[math.floor(i * len(instances) / count)] for i in range(count)]
    for _, module in chosen:
        forward = partial(_checkpointed, module, _surgery.original_forward(module))
        forward._speedkit = True  # type: ignore[attr-defined]
        _surgery.replace_forward(module, forward)
    return [name for name, _ in chosen]


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


def uncheckpoint_blocks(model: nn.Module) -> list[str]:
    """Undo :func:`checkpoint_blocks`; returns the names restored."""
    restored = []
    for name, module in model.named_modules():
        forward = _surgery.replaced_forward(module)
        if isinstance(forward, partial) and forward.func is _checkpointed:
            _surgery.restore_forward(module)
            restored.append(name)
    return restored


class ActivationCheckpointing(L.Callback):
    """Runs :func:`checkpoint_blocks` on the LightningModule in ``setup``.

    Before the strategy wraps the model, so it works the same under DDP, the ZeRO-2
    presets and DeepSpeed: each wrapped unit sees a block whose forward recomputes in
    backward. The blocks checkpointed are printed (rank 0) and kept on a later
    ``fit``.

    Args:
        blocks: ``"auto"`` (the model's repeated blocks) or module classes or names.
        fraction: share of the blocks to checkpoint, spread evenly (default all).
        verbose: print what was checkpointed.

    Example::

        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[ActivationCheckpointing(fraction=0.5)], logger=False)
    """

    def __init__(
        self, blocks: BlockChoice = "auto", fraction: float = 1.0, *, verbose: bool = True
    ) -> None:
        _check_fraction(fraction)
        self.blocks = blocks
        self.fraction = fraction
        self.verbose = verbose
        self.checkpointed: list[str] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.checkpointed or stage != "fit":
            return
        self.checkpointed = checkpoint_blocks(pl_module, self.blocks, self.fraction)
        if not self.verbose:
            return
        if self.checkpointed:
            kinds = sorted({type(pl_module.get_submodule(n)).__name__ for n in self.checkpointed})
            rank_zero_info(
                f"ActivationCheckpointing: {len(self.checkpointed)} blocks "
                f"({', '.join(kinds)}) recompute their activations in backward"
            )
        else:
            rank_zero_info("ActivationCheckpointing: no repeated blocks found; nothing changed")
