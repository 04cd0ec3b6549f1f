from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from speedkit_examples.vlm import VLM, CaptionTokenizer, VLMConfig, VLMTask
from speedkit_examples.vlm import model as model_mod
from speedkit_examples.vlm.model import CausalSelfAttention, VisionSelfAttention

VOCAB = CaptionTokenizer().vocab_size
EXAMPLES = Path(model_mod.__file__).resolve().parent


def _documented_counts() -> dict[str, int]:
    doc = model_mod.__doc__ or ""
    return {
        m[0]: int(m[1].replace(",", ""))
        for m in re.findall(r"^(\w+)\s+.*?([\d,]{6,})\s+", doc, re.M)
    }


def test_documented_parameter_counts_are_current() -> None:
    documented = _documented_counts()
    assert set(documented) == {"tiny", "small", "base"}
    assert f"{VOCAB}-token vocabulary" in (model_mod.__doc__ or "")
    for name, count in documented.items():
        with torch.device("meta"):  # base has ~290 M parameters: count without allocating
            model = VLM(VLMConfig.preset(name, VOCAB))  # type: ignore[arg-type]
        assert sum(p.numel() for p in model.parameters()) == count, name
    assert documented["base"] > 100_000_000  # "hundreds of millions" for GPU benchmarks


def test_forward_gives_logits_for_every_text_position() -> None:
    model = VLM(VLMConfig.preset("tiny", VOCAB))
    logits = model(torch.randn(3, 3, 32, 32), torch.randint(0, VOCAB, (3, 11)))
    assert logits.shape == (3, 11, VOCAB)


def test_decoder_is_causal_and_reads_the_image() -> None:
    torch.manual_seed(0)
    model = VLM(VLMConfig.preset("tiny", VOCAB)).eval()
    images, ids = torch.randn(2, 3, 32, 32), torch.randint(4, VOCAB, (2, 12))
    with torch.no_grad():
        base = model(images, ids)
        changed_future = ids.clone()
        changed_future[:, 8:] = 5
        assert torch.equal(model(images, changed_future)[:, :8], base[:, :8])
        assert not torch.allclose(model(images, changed_future)[:, 8:], base[:, 8:])
        assert not torch.allclose(model(torch.randn(2, 3, 32, 32), ids), base, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_plain_attention_matches_sdpa(causal: bool) -> None:
    torch.manual_seed(0)
    dim, heads, B, S = 32, 4, 2, 10
    x = torch.randn(B, S, dim)
    if causal:
        attn: torch.nn.Module = CausalSelfAttention(dim, heads, max_len=16)
        q, k, v = (
            p(x).view(B, S, heads, -1).transpose(1, 2)
            for p in (attn.q_proj, attn.k_proj, attn.v_proj)
        )  # type: ignore[operator]
        out_proj = attn.o_proj
    else:
        attn = VisionSelfAttention(dim, heads)
        q, k, v = attn.qkv(x).view(B, S, 3, heads, -1).permute(2, 0, 3, 1, 4)  # type: ignore[operator]
        out_proj = attn.proj
    ref = (
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).reshape(B, S, dim)
    )
    torch.testing.assert_close(attn(x), out_proj(ref))  # type: ignore[operator]


def test_attention_is_written_out_not_fused() -> None:
    """AttentionSwap needs something to swap: the example must not call a fused kernel."""
    source = (EXAMPLES / "model.py").read_text()
    assert "scaled_dot_product_attention" not in source
    assert "softmax" in source
    assert "causal_mask" in source


def test_examples_contain_no_speedkit_code() -> None:
    speedkit_import = re.compile(r"^\s*(from|import)\s+lightning_speedkit", re.M)
    for path in EXAMPLES.rglob("*.py"):
        if path.name == "cli.py":  # the training script imports the kit for its strategy names
            continue
        assert not speedkit_import.search(path.read_text()), path


def test_frozen_vision_tower_gets_no_gradients_or_optimizer_state() -> None:
    cfg = VLMConfig.preset("tiny", VOCAB, freeze_vision=True)
    task = VLMTask(cfg)
    vision = {id(p) for p in task.model.vision.parameters()}
    optimizer = task.configure_optimizers()["optimizer"]
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized.isdisjoint(vision)
    assert optimized == {id(p) for p in task.model.parameters() if id(p) not in vision}
    logits = task(torch.randn(2, 3, 32, 32), torch.randint(0, VOCAB, (2, 6)))
    logits.sum().backward()
    assert all(p.grad is None for p in task.model.vision.parameters())
    assert all(p.grad is not None for p in task.model.projector.parameters())


@pytest.mark.parametrize(
    ("overrides", "field"),
    [({"image_size": 30}, "image_size"), ({"text_dim": 65}, "text_dim")],
)
def test_bad_shapes_are_refused(overrides: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        VLMConfig.preset("tiny", VOCAB, **overrides)


def test_unknown_preset_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"choose one of \['base', 'small', 'tiny'\]"):
        VLMConfig.preset("huge", VOCAB)  # type: ignore[arg-type]
