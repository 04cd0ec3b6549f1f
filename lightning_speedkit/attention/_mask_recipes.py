"""Masks made from a module's buffers alone, and whether one is SDPA's causal mask.

While the fused forward runs, every tensor made from the module's buffers alone
(not from its inputs, its parameters or other attributes) gets a recipe: how it was
made, op by op. A mask with a recipe is the same at every call of a shape, so
whether it is lower-triangular (SDPA's ``is_causal=True``, which flash kernels can
run) is checked once per recipe and shape, a host-device sync, and remembered.
Any other mask is passed to the fused call as ``attn_mask``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_speedkit.attention._op_vocabulary import _inplace, _number, _tensor_outputs

if TYPE_CHECKING:
    from lightning_speedkit.attention._deferred_scores import _Scores

#: A ``masked_fill`` value at or below this is a mask (softmax gives it no weight).
_VERY_NEGATIVE = -1e4


def _negative(value: Any) -> bool:
    return _number(value) and float(value) <= _VERY_NEGATIVE


def _recipe_value(value: Any, recipes: WeakTensorKeyDictionary) -> Any:
    """A hashable stand-in for an argument of an op that makes a constant, or ``_NOT``."""
    if isinstance(value, Tensor):
        return recipes.get(value, _NOT)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if value is Ellipsis:
        return "..."
    if isinstance(value, slice):
        parts = tuple(_recipe_value(v, recipes) for v in (value.start, value.stop, value.step))
        return _NOT if _NOT in parts else ("slice", *parts)
    if isinstance(value, (list, tuple)):
        parts = tuple(_recipe_value(v, recipes) for v in value)
        return _NOT if _NOT in parts else parts
    return _NOT


_NOT = ("not a constant",)
_MAX_RECIPE = 64


class BufferRecipes:
    """How each tensor made from a module's buffers alone was made, during one call.

    Such a mask is the same at every call of a shape. Inputs, parameters and
    attributes have no recipe, nor has anything made with them.
    """

    def __init__(self, module: nn.Module) -> None:
        self.recipes: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.maybe: set[int] = set()  # ids of those (a quick first test; ids can be reused)
        for name, buffer in module.named_buffers():
            self.recipes[buffer] = ("buffer", name)
            self.maybe.add(id(buffer))

    def note(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        tensors: list[Tensor],
        out: Any,
    ) -> None:
        """Give what this call made a recipe if it made it from recipes alone; else none."""
        if tensors and not all(id(t) in self.maybe and t in self.recipes for t in tensors):
            if _inplace(name):  # a constant written with inputs
                self.recipes.pop(tensors[0], None)
            return
        named = tuple(sorted(kwargs.items()))
        recipe = (name, _recipe_value(args, self.recipes), _recipe_value(named, self.recipes))
        if _NOT in recipe or len(repr(recipe)) > 40 * _MAX_RECIPE:
            if tensors:
                self.recipes.pop(tensors[0], None)
            return
        outputs = _tensor_outputs(out)
        if _inplace(name) and tensors:
            outputs = [tensors[0]]  # changed in place: its value has a new recipe
        for index, tensor in enumerate(outputs):
            self.recipes[tensor] = (recipe, index)
            self.maybe.add(id(tensor))

    def get(self, t: Tensor) -> Any:
        """``t``'s recipe, ``None`` when it was not made from buffers alone."""
        return self.recipes.get(t)

    def extend(
        self, recipe: tuple[Any, ...] | None, kind: str, mask: Tensor, *extra: Any
    ) -> tuple[Any, ...] | None:
        """The scores' mask recipe after ``kind`` applies ``mask``; ``None``: not from buffers."""
        made = self.get(mask)
        if recipe is None or made is None:
            return None
        return (*recipe, (kind, made, *extra))


def sdpa_mask(
    s: _Scores, nq: int, nk: int, causal_masks: dict[Any, bool]
) -> tuple[Tensor | None, bool]:
    """SDPA's ``attn_mask`` and ``is_causal`` for the scores' masks.

    ``causal_masks``: whether a mask made from buffers alone is causal, by its recipe and
    shape; filled in here the first time one is seen.
    """
    keep, bias = s.keep, s.bias
    if keep is None and bias is None:
        return None, False
    if s.mask_recipe is not None:  # made from buffers alone: one answer per recipe and shape
        key = (nq, nk, s.mask_recipe)
        causal = causal_masks.get(key)
        if causal is None:
            causal = _lower_triangular(keep, bias, nq, nk)
            causal_masks[key] = causal
        if causal:
            return None, True
    if bias is None:
        return keep, False
    return (bias if keep is None else bias.masked_fill(~keep, float("-inf"))), False


def _lower_triangular(keep: Tensor | None, bias: Tensor | None, nq: int, nk: int) -> bool:
    """Whether the masks let each query see exactly the keys at or before it (SDPA's causal)."""
    allowed = keep
    if bias is not None:
        zero = bias == 0
        if not bool((zero | (bias <= _VERY_NEGATIVE)).all()):  # SYNC: once per mask recipe
            return False
        allowed = zero if allowed is None else allowed & zero
    assert allowed is not None
    tril = torch.ones(nq, nk, dtype=torch.bool, device=allowed.device).tril()
    return bool((allowed == tril).all())  # SYNC: once per mask recipe
