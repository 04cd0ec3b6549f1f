"""FrozenFeatureCache on Hugging Face vision towers from tiny configs (no download).

Each tower is called as its users call it: with keyword arguments (``pixel_values=``),
flags (``output_hidden_states=True``, ``return_dict``), returning a ``ModelOutput``
dataclass or a tuple; and a CLIP model in locked-image tuning (the image side frozen, the
text side trained on the contrastive loss). The losses must be bit for bit the plain run's.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit import AttentionSwap
from lightning_speedkit.compute.frozen_feature_cache import FrozenFeatureCache
from tests.helpers.one_thread import one_intra_op_thread  # noqa: F401 (autouse)

from .test_frozen_newuser_common import fit, same_losses

transformers = pytest.importorskip("transformers")


_SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
_IMAGES = {"image_size": 32, "patch_size": 8}


def _tower(kind: str) -> nn.Module:
    if kind == "clip":
        config = transformers.CLIPVisionConfig(**_SIZES, **_IMAGES, intermediate_size=64)
        return transformers.CLIPVisionModel(config)
    if kind == "siglip":
        config = transformers.SiglipVisionConfig(**_SIZES, **_IMAGES, intermediate_size=64)
        return transformers.SiglipVisionModel(config)
    if kind == "vit":
        return transformers.ViTModel(
            transformers.ViTConfig(**_SIZES, **_IMAGES, intermediate_size=64)
        )
    return transformers.Dinov2Model(transformers.Dinov2Config(**_SIZES, **_IMAGES, mlp_ratio=2))


class _Pictures(Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        text = torch.randint(0, 60, (7,), generator=g)
        return {
            "pixel_values": torch.randn(3, 32, 32, generator=g),
            "input_ids": text,
            "label": i % 3,
        }


def _loader() -> DataLoader[Any]:
    return DataLoader(_Pictures(), batch_size=6, shuffle=True)


class _Probe(L.LightningModule):
    """A frozen tower's pooled output and a middle hidden state into a trainable head."""

    kind = "clip"
    return_dict = True

    def __init__(self) -> None:
        super().__init__()
        self.tower = _tower(self.kind).requires_grad_(False)
        self.head = nn.Linear(64, 3)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        out = self.tower(
            pixel_values=batch["pixel_values"],
            output_hidden_states=True,
            return_dict=self.return_dict,
        )
        pooled, hidden = (
            (out.pooler_output, out.hidden_states) if self.return_dict else (out[1], out[2])
        )
        features = torch.cat([pooled, hidden[1].mean(1)], dim=1)
        loss = F.cross_entropy(self.head(features), batch["label"])
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("kind", "return_dict"), [("clip", False), ("siglip", True), ("vit", True), ("dinov2", True)]
)
def test_a_transformers_tower_called_with_keywords_and_flags_is_served_bitwise(
    kind: str, return_dict: bool
) -> None:
    model = type(f"{kind}Probe", (_Probe,), {"kind": kind, "return_dict": return_dict})
    rows: list[int] = []

    def make() -> L.LightningModule:
        probe = model()  # the embeddings run only when the tower really does
        embed = next(m for n, m in probe.tower.named_modules() if n.endswith("embeddings"))
        embed.register_forward_hook(lambda m, a, out: rows.append(out.shape[0]))
        return probe

    plain = fit(make, _loader, None)
    rows.clear()
    cache = FrozenFeatureCache()  # "auto": found by the keyword argument it is called with
    cached = fit(make, _loader, cache)
    assert same_losses(plain, cached, 12)
    assert cache.cache is not None
    assert list(cache.cache.modules) == ["tower"]
    counts = cache.counts
    assert (counts["stood_down"], counts["plain_calls"]) == ({}, 0)
    # The batch that found it is stored too: epoch 1 runs 24, epoch 2's first batch is
    # checked (6 run), and the rest is served
    assert (counts["misses"], counts["hits"], rows) == (30, 42, [6] * 5)


class _Dropping(_Probe):
    """CLIP with attention dropout: called as a function, not a layer the cache could see."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.CLIPVisionConfig(
            **_SIZES, **_IMAGES, intermediate_size=64, attention_dropout=0.2
        )
        self.tower = transformers.CLIPVisionModel(config).requires_grad_(False)


def test_a_tower_with_functional_dropout_in_train_mode_runs_as_it_is_with_the_reason() -> None:
    plain = fit(_Dropping, _loader, None)
    cache = FrozenFeatureCache()
    said = (
        r"runs `tower` without the store: .*self_attn` is a CLIPAttention with dropout=0.2 "
        r"in train mode: random output.*eval mode"
    )
    with pytest.warns(UserWarning, match=said):
        cached = fit(_Dropping, _loader, cache)
    assert same_losses(plain, cached, 12)  # the same random draws: the tower always ran
    assert cache.counts["hits"] == 0


class _LockedImage(L.LightningModule):
    """CLIP in locked-image tuning: image tower and projection frozen, text side trained."""

    def __init__(self) -> None:
        super().__init__()
        text = transformers.CLIPTextConfig(**_SIZES, intermediate_size=64, vocab_size=64,
                                           max_position_embeddings=16)  # fmt: skip
        vision = transformers.CLIPVisionConfig(**_SIZES, **_IMAGES, intermediate_size=64)
        config = transformers.CLIPConfig(
            text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=16
        )
        self.clip = transformers.CLIPModel(config)
        self.clip.vision_model.requires_grad_(False)
        self.clip.visual_projection.requires_grad_(False)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        out = self.clip(
            input_ids=batch["input_ids"], pixel_values=batch["pixel_values"], return_loss=True
        )
        self.losses.append(out.loss.detach().clone())
        return out.loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_locked_image_tuning_of_clip_serves_the_image_tower_with_the_plain_losses() -> None:
    plain = fit(_LockedImage, _loader, None)
    cache = FrozenFeatureCache()
    cached = fit(_LockedImage, _loader, cache)
    assert same_losses(plain, cached, 12)
    assert cache.cache is not None
    assert list(cache.cache.modules) == ["clip.vision_model"]
    assert cache.counts["hits"] >= 24
    assert cache.counts["stood_down"] == {}


def test_attention_swaps_checks_beside_the_step_are_neither_served_nor_counted() -> None:
    """AttentionSwap checks a swapped transformers model by running its own forward on
    copies of the inputs that require grad: the cache inside took that for the step's call,
    said the tower's input "comes from a trainable module" and counted it as run plain."""
    swap = AttentionSwap("sdpa", measure=False, verbose=False)
    plain = fit(_LockedImage, _loader, None, extra=(AttentionSwap("sdpa", measure=False),))
    cache = FrozenFeatureCache(modules=["clip.vision_model"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cached = fit(_LockedImage, _loader, cache, extra=(swap,))
    assert not [w for w in caught if "FrozenFeatureCache" in str(w.message)]
    assert same_losses(plain, cached, 12)
    counts = cache.counts
    # 24 samples run once, and the batch that checks: none of AttentionSwap's runs
    assert (counts["plain_calls"], counts["misses"], counts["stored"]) == (0, 24 + 6, 24)
