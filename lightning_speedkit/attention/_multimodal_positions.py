"""A packed batch's ``position_ids`` handed to a model with multimodal rotary positions.

Qwen2-VL's rotary positions (M-RoPE, ``mrope_section`` in its text config's rope
parameters; Qwen2.5-VL, Qwen3-VL and GLM-4V have them too) are 3-D: an image's tokens
get a time, a height and a width position, which the model computes from ``input_ids``
and ``image_grid_thw``. Given 2-D ``position_ids`` (``PackingCollate``'s, restarting per
document), it uses them as one plain position on all three axes, so an image's tokens
are placed as a line of text: each document's per-token losses came out 6.1e-4 off the
document alone (a tiny Qwen2-VL, fp32), with nothing said. Left out, the model builds
its own M-RoPE positions over the packed row; they run on from one document into the
next, but each document's three axes start from one offset, and rotary attention, cut
per document, sees only the distances within it: exact (0.0 off, tested). The kit does
not build per-document M-RoPE positions itself: that is the model's own code
(``get_rope_index``), and it already gives the right answer without them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_speedkit.attention import _documents


def warn_if_multimodal_rope(module: nn.Module, config: Any, kwargs: dict[str, Any]) -> None:
    """Say once that a packed batch's 2-D ``position_ids`` reached a model whose rotary
    positions are multimodal (see the module's docstring), with the fix; the outermost
    such model is named (its language model gets the same positions next)."""
    positions = kwargs.get("position_ids")
    if not isinstance(positions, Tensor) or positions.ndim != 2:
        return  # none given, or 3-D: M-RoPE positions of the caller's own
    if _documents.active() is None or not multimodal_rope(config):
        return
    _documents.warn_once(
        f"A packed batch's 2-D `position_ids` reached {type(module).__name__}, whose rotary "
        "positions are multimodal (M-RoPE: `mrope_section` in its rope parameters, as in "
        "Qwen2-VL): it reads them as one plain position on all three axes, so an image's "
        "tokens get the positions of a line of text and each document computes other "
        "numbers than alone. Leave `position_ids` out for this model: it builds its own "
        "M-RoPE positions from `input_ids` and `image_grid_thw`, and with the attention cut "
        "per document each document then gets what it gets alone.",
        key="multimodal rope positions",
    )


def multimodal_rope(config: Any) -> bool:
    """Whether a transformers config (or its text config) asks for multimodal rotary
    positions: ``mrope_section`` in its rope parameters, or the rope type ``mrope``."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else None
    for owner in (config, text):
        for name in ("rope_parameters", "rope_scaling"):
            rope = getattr(owner, name, None)
            if not isinstance(rope, dict):
                continue
            # one set, or one per layer type (Gemma 3's ``{"full_attention": {...}, ...}``)
            sets = [rope, *(v for v in rope.values() if isinstance(v, dict))]
            if any(
                "mrope_section" in r or "mrope" in (r.get("type"), r.get("rope_type")) for r in sets
            ):
                return True
    return False
