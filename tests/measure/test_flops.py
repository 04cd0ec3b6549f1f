from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightning_speedkit import count_flops
from lightning_speedkit.measure.flops import EXTRA_FORMULAS
from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMTask
from speedkit_examples.vlm.model import LanguageModel


def test_linear_training_flops_are_six_per_weight_per_token() -> None:
    tokens, d_in, d_out = 24, 64, 48
    layer = torch.nn.Linear(d_in, d_out, bias=False)
    x = torch.randn(tokens, d_in, requires_grad=True)  # as inside a network: input grads needed
    result = count_flops(lambda: layer(x).sum().backward())
    assert result.total == 6 * d_in * d_out * tokens
    assert result.model == result.total  # nothing recomputed


def test_frozen_weights_cost_no_weight_gradient_flops() -> None:
    tokens, d = 16, 32
    layer = torch.nn.Linear(d, d, bias=False).requires_grad_(False)
    x = torch.randn(tokens, d, requires_grad=True)
    assert count_flops(lambda: layer(x).sum().backward()).total == 4 * d * d * tokens  # fwd + dX


@pytest.mark.parametrize(("B", "H", "S", "D"), [(2, 4, 64, 16), (1, 2, 200, 32)])
def test_sdpa_forward_is_four_b_h_s2_d_on_cpu(B: int, H: int, S: int, D: int) -> None:
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
    result = count_flops(F.scaled_dot_product_attention, q, k, v)
    assert result.total == 4 * B * H * S * S * D  # torch alone counts 0 for the CPU kernel
    assert set(result.by_operator) == {"aten._scaled_dot_product_flash_attention_for_cpu"}


def test_sdpa_backward_is_priced_on_cpu() -> None:
    B, H, S, D = 2, 2, 32, 8
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    result = count_flops(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward())
    forward = 4 * B * H * S * S * D
    # The fused backward recomputes QK^T (half a forward): hardware FLOPs only.
    assert result.model == 3 * forward
    assert result.total == 3 * forward + forward // 2


def test_gpt_decoder_matches_palm_formula_within_three_percent() -> None:
    """Training FLOPs per token = 6N + 12·L·H·Q·T (PaLM, appendix B), N without embeddings."""
    cfg = VLMConfig(vocab_size=512, text_dim=256, text_depth=4, text_heads=8, max_text_len=128)
    decoder = LanguageModel(cfg)
    B, T = 2, 128
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    empty_prefix = torch.zeros(B, 0, cfg.text_dim)

    def step() -> None:
        logits = decoder(ids, empty_prefix)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()

    per_token = count_flops(step).total / (B * T)
    n = sum(p.numel() for name, p in decoder.named_parameters() if "embed" not in name)
    L_, H, Q = cfg.text_depth, cfg.text_heads, cfg.text_dim // cfg.text_heads
    palm = 6 * n + 12 * L_ * H * Q * T
    assert per_token == pytest.approx(palm, rel=0.03)


def test_recomputation_counts_for_hfu_not_mfu() -> None:
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(3)))
    x = torch.randn(8, 32, requires_grad=True)
    plain = count_flops(lambda: blocks(x).sum().backward())
    recomputed = count_flops(lambda: checkpoint(blocks, x, use_reentrant=False).sum().backward())
    assert recomputed.model == plain.model == plain.total
    # The forward of the first two linears runs again in backward (the last one's output
    # is not needed by sum's backward, so non-reentrant checkpointing stops before it).
    assert recomputed.recomputed == 2 * (2 * 32 * 32 * 8)
    assert recomputed.total == plain.total + recomputed.recomputed


def test_breakdown_looks_through_wrappers_to_the_vlm_towers() -> None:
    vocab = CaptionTokenizer().vocab_size
    task = VLMTask(VLMConfig.preset("tiny", vocab, freeze_vision=False))
    batch = {"images": torch.randn(4, 3, 32, 32), "input_ids": torch.randint(0, vocab, (4, 20))}

    def step() -> None:
        logits = task(batch["images"], batch["input_ids"][:, :-1])
        task._loss(logits, batch["input_ids"][:, 1:]).backward()

    result = count_flops(step)
    assert set(result.by_module) == {"vision", "projector", "language_model"}
    assert sum(result.by_module.values()) == result.total
    assert result.by_module["language_model"] > result.by_module["projector"]
    assert result.by_path["VLMTask.model.vision"] == result.by_module["vision"]


def test_freezing_the_vision_tower_removes_its_weight_gradients() -> None:
    vocab = CaptionTokenizer().vocab_size
    images, ids = torch.randn(4, 3, 32, 32), torch.randint(0, vocab, (4, 12))

    def flops(frozen: bool) -> dict[str, int]:
        task = VLMTask(VLMConfig.preset("tiny", vocab, freeze_vision=frozen))
        return count_flops(lambda: task(images, ids).sum().backward()).by_module

    trained, frozen = flops(False), flops(True)
    assert frozen["language_model"] == trained["language_model"]
    # Trained: forward + dX + dW = 3 units; frozen and first in line: forward only.
    assert frozen["vision"] < trained["vision"] / 2.5


def test_flash_attn_kernels_are_priced_through_a_stand_in() -> None:
    """flash-attn is not installable here: a stand-in op of the same name and layout
    (batch, seq, heads, dim) checks the dispatch; numerics need a GPU with flash-attn."""
    B, S, H, D = 2, 48, 4, 16
    q = torch.randn(B, S, H, D)
    forward = EXTRA_FORMULAS["flash_attn::_flash_attn_forward"]
    backward = EXTRA_FORMULAS["flash_attn::_flash_attn_backward"]
    assert forward(q, q, q, 0.0, None, True) == 4 * B * H * S * S * D
    assert backward(q, q, q, q) == 10 * B * H * S * S * D  # dV, dP, dQ, dK and QK^T again

    name = "speedkit_test_flash::fwd"

    @torch.library.custom_op(name, mutates_args=())
    def fake_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q.clone()

    EXTRA_FORMULAS[name] = forward
    try:
        assert count_flops(fake_flash, q, q, q).total == 4 * B * H * S * S * D
    finally:
        del EXTRA_FORMULAS[name]


def test_varlen_flash_counts_each_document_alone() -> None:
    H, D = 2, 8
    lengths = [10, 30, 24]
    total = sum(lengths)
    q = torch.randn(total, H, D)
    cu = torch.tensor([0, 10, 40, 64], dtype=torch.int32)
    forward = EXTRA_FORMULAS["flash_attn::_flash_attn_varlen_forward"]
    assert forward(q, q, q, cu, cu) == 4 * H * D * sum(n * n for n in lengths)


def test_xformers_kernels_are_priced_dense_and_variable_length() -> None:
    """xformers has no CPU kernel: the formulas are checked on tensors of its layout."""
    B, S, H, D = 2, 40, 3, 8
    q = torch.randn(B, S, H, D)
    forward = EXTRA_FORMULAS["xformers::efficient_attention_forward_cutlass"]
    backward = EXTRA_FORMULAS["xformers::efficient_attention_backward_cutlass"]
    assert forward(q, q, q, None, None, None) == 4 * B * H * S * S * D
    assert backward(q, q, q, q) == 10 * B * H * S * S * D
    packed = torch.randn(1, 50, H, D)  # two documents of 20 and 30 tokens in one row
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    assert forward(packed, packed, packed, None, cu, cu, 30) == 4 * H * D * (20**2 + 30**2)
    assert backward(packed, packed, packed, packed, None, cu, cu) == 10 * H * D * (20**2 + 30**2)


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class _NanoGPTLike(torch.nn.Module):
    """nanoGPT's layout: the blocks in a ModuleList inside a ModuleDict, neither ever called."""

    def __init__(self, d: int = 16, vocab: int = 32, layers: int = 3) -> None:
        super().__init__()
        self.transformer = torch.nn.ModuleDict(
            {"wte": torch.nn.Embedding(vocab, d),
             "h": torch.nn.ModuleList(_Block(d) for _ in range(layers)),
             "ln_f": torch.nn.LayerNorm(d)}
        )  # fmt: skip
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.transformer["wte"](ids)
        for block in self.transformer["h"]:
            x = block(x)
        return self.lm_head(self.transformer["ln_f"](x))


def test_by_module_descends_into_containers_that_are_never_called() -> None:
    d, vocab, layers, tokens = 16, 32, 3, 2 * 10
    model = _NanoGPTLike(d, vocab, layers)
    ids = torch.randint(0, vocab, (2, 10))
    result = count_flops(lambda: model(ids).sum().backward())
    assert "(own operators)" not in result.by_module  # was 90% of the model
    assert set(result.by_module) == {"transformer", "lm_head"}
    assert result.by_module["lm_head"] == 6 * d * vocab * tokens
    blocks = sum(result.by_path[f"_NanoGPTLike.transformer.h.{i}"] for i in range(layers))
    assert blocks == layers * 6 * d * d * tokens
    assert result.by_module["transformer"] == result.model - result.by_module["lm_head"]
    # a bare ModuleList of blocks beside a layer gives one row for all the blocks
    stack = _Stack(d, layers)
    x = torch.randn(tokens, d, requires_grad=True)
    rows = count_flops(lambda: stack(x).sum().backward()).by_module
    assert rows == {"blocks": layers * 6 * d * d * tokens, "stem": 6 * d * d * tokens}


class _Stack(torch.nn.Module):
    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(d, d, bias=False)
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


class _Branches(torch.nn.Module):
    """Two siblings fed the same input: their backward passes run side by side."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(d, d, bias=False)
        self.decoder = torch.nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x) + self.decoder(x)


class _Chain(_Branches):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def test_by_module_gives_each_operator_to_one_module_so_the_rows_add_up() -> None:
    d, tokens = 64, 32
    x = torch.randn(tokens, d)  # no gradient: neither layer computes dX of x
    matmul = 2 * d * d * tokens  # forward, dW and dX each
    for model, expected in (
        (_Branches(d), {"encoder": 2 * matmul, "decoder": 2 * matmul}),
        (_Chain(d), {"encoder": 2 * matmul, "decoder": 3 * matmul}),
    ):
        result = count_flops(lambda m=model: m(x).sum().backward())
        assert result.by_module == expected  # each branch was credited the other's backward
        assert sum(result.by_module.values()) == result.model == result.total
        assert result.by_path["Global"] == result.total


class _Recursive(torch.nn.Module):
    """Calls itself: each operator once in its row, not once per level of the recursion."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, depth: int = 2) -> torch.Tensor:
        y = self.lin(x)
        return self(y, depth - 1) if depth > 1 else y


def test_a_module_that_calls_itself_is_credited_once_per_operator() -> None:
    d, tokens = 16, 8
    model = _Recursive(d)
    result = count_flops(lambda: model(torch.randn(tokens, d)).sum().backward())
    assert result.by_path["Global"] == result.total
    assert result.by_path["_Recursive"] == result.total  # was 1.6x: the outer level twice
    assert result.by_path["_Recursive.lin"] == result.total


def test_by_module_adds_up_through_checkpoint_recomputation() -> None:
    d, tokens = 32, 8
    x = torch.randn(tokens, d, requires_grad=True)  # as inside a network
    matmul = 2 * d * d * tokens
    for reentrant in (True, False):
        model = _Chain(d)
        result = count_flops(
            lambda m=model, r=reentrant: checkpoint(m, x, use_reentrant=r).sum().backward()
        )
        assert result.by_module == {"encoder": 3 * matmul, "decoder": 3 * matmul}
        assert sum(result.by_module.values()) == result.model == 6 * matmul
        assert result.recomputed > 0


def test_by_module_of_an_encoder_decoder_transformer_adds_up() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    d, d_ff, d_kv, heads, layers, vocab = 32, 64, 16, 2, 2, 128
    config = transformers.T5Config(
        num_layers=layers, num_decoder_layers=layers, d_model=d, d_ff=d_ff, d_kv=d_kv,
        num_heads=heads, vocab_size=vocab, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    b, s_enc, s_dec = 4, 32, 16
    ids, labels = torch.randint(0, vocab, (b, s_enc)), torch.randint(0, vocab, (b, s_dec))
    result = count_flops(lambda: model(input_ids=ids, labels=labels).loss.backward())
    # Encoder: q, k, v, o (d x d) and the feed-forward (d x d_ff, d_ff x d) per layer, 6 FLOPs
    # per weight per token, plus attention scores and mix (2 matmuls, 3x for backward).
    weights = 4 * d * d + 2 * d * d_ff
    attention = 3 * 2 * 2 * b * heads * s_enc * s_enc * d_kv
    assert result.by_module["encoder"] == layers * (6 * weights * b * s_enc + attention)
    assert result.by_module["lm_head"] == 6 * d * vocab * b * s_dec
    assert sum(result.by_module.values()) == result.model == result.total  # was 34% over
