"""The bottleneck report's vision-tower finding goes by module names: a word inside another
word is no vision tower. An MoE model's ``dispatcher`` (its "patch") or a module named
``activity`` (its "vit") taking half the step was reported as "the vision tower
`dispatcher`", with advice to freeze it and lower the image resolution."""

from __future__ import annotations

import pytest

from lightning_speedkit.measure.report.rules import vision_encoder_rule

from .test_report_rules import evidence

SHARES = {"matmul": 0.9, "overhead": 0.1}  # compute: 90% of the step


@pytest.mark.parametrize(
    "name",
    ["vision", "vision_tower", "model.visual", "image_encoder", "img_enc", "vit", "ViT",
     "clipVision", "VisionTower", "pixel_embed", "patch_embed", "encoder.vit_blocks"],
)  # fmt: skip
def test_vision_names_are_found(name: str) -> None:
    finding = vision_encoder_rule(evidence(SHARES, modules={name: 0.5, "decoder": 0.5}), ())
    assert finding is not None
    assert finding.evidence == (
        f"the vision tower `{name}` takes 50% of forward time, about 45% of the step"
    )


@pytest.mark.parametrize("name", ["dispatcher", "activity", "gravity_model", "moe.dispatch"])
def test_a_vision_word_inside_another_word_is_not(name: str) -> None:
    assert vision_encoder_rule(evidence(SHARES, modules={name: 0.5, "decoder": 0.5}), ()) is None
