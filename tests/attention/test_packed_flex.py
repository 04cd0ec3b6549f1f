"""The ``flex`` backend on packed batches: one FlexAttention call with a document block mask.

FlexAttention's forward runs eagerly on CPU (its reference implementation; no backward
there), so the mask and the dispatch are checked here against the per-document SDPA
path; the compiled kernel, with its backward, on a GPU (marked ``gpu``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_speedkit import swap_attention
from lightning_speedkit.attention import backends, packed_documents
from lightning_speedkit.attention.backends import Attend
from lightning_speedkit.data import PackingCollate

from .test_packed_documents import NanoGPT, _samples

LENGTHS = (5, 3, 7, 2, 4, 6)  # rows of 12: [5, 3, pad 4], [7, 2, pad 3], [4, 6, pad 2]


@pytest.fixture(autouse=True)
def _quiet_eager_flex() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        yield


def _batch() -> dict[str, Any]:
    return PackingCollate(max_tokens=12)([{"input_ids": torch.zeros(n, dtype=torch.long)}
                                          for n in LENGTHS])  # fmt: skip


def _qkv(kv_heads: int = 4, grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 12, 16, generator=g)
    k, v = (torch.randn(3, kv_heads, 12, 16, generator=g) for _ in range(2))
    return q.requires_grad_(grad), k.requires_grad_(grad), v.requires_grad_(grad)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_flex_with_a_document_mask_equals_per_document_sdpa(
    causal: bool, kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.nn.attention import flex_attention as flex_module

    built: list[tuple[Any, ...]] = []
    real = flex_module.create_block_mask

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(args[1:5])
        return real(*args, **kwargs)

    monkeypatch.setattr(flex_module, "create_block_mask", counting)
    flex_calls: list[tuple[int, ...]] = []
    real_flex = backends._flex_function

    def recording(device: torch.device) -> Any:
        fn = real_flex(device)
        return lambda q, *a, **kw: flex_calls.append(tuple(q.shape)) or fn(q, *a, **kw)

    monkeypatch.setattr(backends, "_flex_function", recording)
    q, k, v = _qkv(kv_heads)
    with packed_documents(_batch()), torch.no_grad():
        reference = Attend("sdpa")(q, k, v, is_causal=causal)  # cut per document
        first = Attend("flex")(q, k, v, is_causal=causal)
        second = Attend("flex")(q, k, v, is_causal=causal)  # the next layer: same mask
    assert flex_calls == [(3, 4, 12, 16)] * 2  # the whole rows, once per call
    assert built == [(3, None, 12, 12)]  # one block mask for the batch
    assert (first - reference).abs().max().item() <= 1e-5
    assert torch.equal(first, second)


def test_flex_training_on_cpu_is_cut_per_document_instead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No FlexAttention backward on CPU: the call is cut, each piece falls back to SDPA."""
    monkeypatch.setattr(backends, "_WARNED", set())  # said once per process: afresh here
    q, k, v = _qkv(grad=True)
    with packed_documents(_batch()):
        reference = Attend("sdpa")(q, k, v, is_causal=True)
        with pytest.warns(UserWarning, match="no backward on CPU"):
            out = Attend("flex")(q, k, v, is_causal=True)
    assert (out - reference).abs().max().item() <= 1e-5
    out.sum().backward()
    assert q.grad is not None


def test_a_model_swapped_to_flex_keeps_packed_documents_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = NanoGPT()
    swap_attention(model, "flex")
    samples = _samples()
    batch = PackingCollate(max_tokens=12)(samples)
    flex_calls: list[tuple[int, ...]] = []
    real_flex = backends._flex_function

    def recording(device: torch.device) -> Any:
        fn = real_flex(device)
        return lambda q, *a, **kw: flex_calls.append(tuple(q.shape)) or fn(q, *a, **kw)

    with torch.no_grad():
        alone = torch.cat([model(s["input_ids"][None], torch.arange(len(s["input_ids"]))[None])[0]
                           for s in samples])  # fmt: skip
        with packed_documents(batch):
            model(batch["input_ids"], batch["position_ids"])  # the first call is checked too
            monkeypatch.setattr(backends, "_flex_function", recording)
            packed = model(batch["input_ids"], batch["position_ids"])
    assert flex_calls == [(3, 4, 12, 8)] * 2  # one call per layer over the whole rows
    real = batch["document_ids"].flatten() >= 0
    assert (packed.flatten(0, 1)[real] - alone).abs().max().item() <= 1e-5


def test_flex_on_cuda_refuses_heads_under_16_wide_for_sdpa() -> None:
    # Before: Inductor's LoweringException ("embedding dimension ... must be at least 16")
    # crashed the step on an H200 (2026-11-29); the device is named, no CUDA needed here.
    def on_cuda(head_dim: int) -> Any:
        return SimpleNamespace(device=torch.device("cuda"), shape=(3, 4, 12, head_dim))

    attend = Attend("flex")
    assert attend._cannot_run(on_cuda(8), None, True) == (
        "compiled FlexAttention needs a head dimension of at least 16, this one has 8"
    )
    assert attend._cannot_run(on_cuda(16), None, True) is None


@pytest.mark.gpu
def test_compiled_flex_trains_packed_as_one_by_one_on_cuda() -> None:
    torch.manual_seed(0)
    model = NanoGPT(dim=64).cuda()  # 4 heads of 16: compiled FlexAttention's narrowest
    report = swap_attention(model, "flex")
    samples = _samples()
    packed_rows = PackingCollate(max_tokens=12)(samples)
    batch = {k: v.cuda() if isinstance(v, Tensor) else v for k, v in packed_rows.items()}

    def losses(ids: Tensor, positions: Tensor, labels: Tensor) -> Tensor:
        logits = model(ids.cuda(), positions.cuda()).flatten(0, 1)
        out = F.cross_entropy(logits, labels.cuda().flatten(), reduction="none")
        return out[labels.cuda().flatten() != -100]

    def grads(loss: Tensor) -> dict[str, Tensor]:
        model.zero_grad()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    alone = torch.cat([losses(s["input_ids"][None], torch.arange(len(s["input_ids"]))[None],
                              s["labels"][None]) for s in samples])  # fmt: skip
    reference = grads(alone.sum())
    with packed_documents(batch):
        packed = losses(batch["input_ids"], batch["position_ids"], batch["labels"])
        packed_grads = grads(packed.sum())
    assert [m.backend.split()[0] for m in report.modules] == ["flex", "flex"]
    # fp32, FlexAttention's kernel against SDPA's: within 1e-4
    assert (packed - alone).abs().max().item() <= 1e-4
    assert packed_grads.keys() == reference.keys()
    assert max((packed_grads[n] - g).abs().max().item() for n, g in reference.items()) <= 1e-4


@pytest.mark.gpu
def test_flex_on_cuda_with_heads_8_wide_trains_packed_on_sdpa() -> None:
    torch.manual_seed(0)
    model = NanoGPT().cuda()  # 4 heads of 8
    batch = {k: v.cuda() if isinstance(v, Tensor) else v
             for k, v in PackingCollate(max_tokens=12)(_samples()).items()}  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:  # said once: at the swap's check
        warnings.simplefilter("always")
        swap_attention(model, "flex")
        with packed_documents(batch):
            model(batch["input_ids"], batch["position_ids"]).sum().backward()
    assert any("at least 16" in str(w.message) for w in caught)
    assert all(p.grad is not None for p in model.parameters())


def test_the_swaps_own_check_says_no_fallback_the_first_real_call_does() -> None:
    # On an H200 a fit swapped to flex said "'flex' cannot run here (cpu: FlexAttention has
    # no backward on CPU)": the swap's check on its own input ran before Lightning moved
    # the model to the GPU, and remembered the CPU's refusal for the module.
    backends._WARNED.clear()
    model = NanoGPT()
    with warnings.catch_warnings(record=True) as at_swap:
        warnings.simplefilter("always")
        swap_attention(model, "flex")
    assert not [w for w in at_swap if "cannot run here" in str(w.message)]
    ids = torch.zeros(1, 12, dtype=torch.long)
    with warnings.catch_warnings(record=True) as in_training:
        warnings.simplefilter("always")
        model(ids, torch.arange(12)[None]).sum().backward()
    said = [str(w.message) for w in in_training if "cannot run here" in str(w.message)]
    assert said == [
        "Attention backend 'flex' cannot run here (cpu: FlexAttention has no backward on "
        "CPU); running 'sdpa' instead."
    ]
