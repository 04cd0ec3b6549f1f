"""A VLM packed with its images: Hugging Face Llava (CLIP vision + Llama, a tiny config).

Each sample is one image and its caption, the image as ``_PATCHES`` placeholder tokens at
the head of ``input_ids`` (as Llava's processor writes them). PackingCollate packs the
tokens and stacks the images in the order their documents sit in the rows; Llava puts
each image's features where its placeholders are, and the kit keeps the documents apart
in the language model. Each document's logits and the gradients are then those of the
sample run alone, in arrival order and first-fit order alike, Trainer-free and in a fit
with AttentionSwap.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap, packed_documents, swap_attention
from lightning_speedkit.data import PackingCollate
from tests.compute.test_frozen_hf import _IMAGE_TOKEN, _PATCHES, _llava
from tests.helpers.one_thread import one_intra_op_thread  # noqa: F401 (autouse)

pytest.importorskip("transformers")

CAPTIONS, MAX_TOKENS = (5, 9, 3, 7, 4, 6), 48  # 16 image tokens + a caption each


def _samples() -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in CAPTIONS:
        ids = torch.cat(
            [torch.full((_PATCHES,), _IMAGE_TOKEN), torch.randint(0, 60, (n,), generator=g)]
        )
        samples.append({"input_ids": ids, "pixel_values": torch.randn(3, 32, 32, generator=g),
                        "labels": ids.masked_fill(ids == _IMAGE_TOKEN, -100)})  # fmt: skip
    return samples


def _token_losses(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-token losses of next-token prediction (labels shifted, -100 left out)."""
    shifted = labels[..., 1:].flatten()
    losses = F.cross_entropy(logits[..., :-1, :].flatten(0, -2), shifted, reduction="none")
    return losses[shifted != -100]


def _alone(model: Any, samples: list[dict[str, Tensor]]) -> Tensor:
    return torch.cat([
        _token_losses(model(input_ids=s["input_ids"][None],
                            pixel_values=s["pixel_values"][None]).logits, s["labels"][None])
        for s in samples
    ])  # fmt: skip


def _packed_losses(model: Any, batch: dict[str, Any]) -> Tensor:
    """The packed rows' per-token losses, in document order (each document's own shift)."""
    logits = model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                   position_ids=batch["position_ids"]).logits  # fmt: skip
    return document_losses(logits, batch)


def document_losses(logits: Tensor, batch: dict[str, Any]) -> Tensor:
    """Packed rows' logits as per-token losses, in document order (each document's shift)."""
    ids, losses = batch["document_ids"], {}
    for row in range(ids.shape[0]):
        for document in ids[row].unique().tolist():
            if document >= 0:
                where = ids[row] == document
                losses[document] = _token_losses(logits[row, where], batch["labels"][row, where])
    return torch.cat([losses[d] for d in sorted(losses)])


@pytest.mark.parametrize("first_fit", [False, True], ids=["in-order", "first-fit"])
def test_llava_packed_with_its_images_gives_each_document_its_own_losses_and_grads(
    first_fit: bool,
) -> None:
    torch.manual_seed(0)
    model = _llava()
    swap_attention(model, "sdpa")
    samples = _samples()
    alone = _alone(model, samples)
    alone_grads = torch.autograd.grad(alone.sum(), list(model.parameters()), allow_unused=True)
    batch = PackingCollate(MAX_TOKENS, first_fit=first_fit)(samples)
    assert batch["input_ids"].shape[0] < len(samples)  # documents share rows
    order = [next(i for i, s in enumerate(samples) if torch.equal(s["pixel_values"], p))
             for p in batch["pixel_values"]]  # fmt: skip
    with packed_documents(batch):
        packed = _packed_losses(model, batch)
        grads = torch.autograd.grad(packed.sum(), list(model.parameters()), allow_unused=True)
    if first_fit:
        assert order != sorted(order)  # the images follow their documents, not the samples
    per_sample = alone.split(
        list(CAPTIONS)
    )  # a loss per caption token (the first's from the image)
    expected = torch.cat([per_sample[i] for i in order])
    assert packed.shape == expected.shape
    assert (packed - expected).abs().max().item() <= 1e-5
    with torch.no_grad():  # without the documents, captions attend to the row's other images
        assert (_packed_losses(model, batch) - expected).abs().max().item() > 1e-2
    pairs = [(g, a) for g, a in zip(grads, alone_grads, strict=True) if a is not None]
    assert max((g - a).abs().max().item() for g, a in pairs) <= 1e-5


class _Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.llava = _llava()
        self.losses: list[Tensor] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        losses = _packed_losses(self.llava, batch)
        self.losses.append(losses.detach())
        return losses.mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_llava_packed_in_a_fit_with_attention_swap_matches_each_sample_alone() -> None:
    torch.manual_seed(0)
    task = _Task()
    alone = _alone(task.llava, _samples())
    loader = DataLoader(_samples(), batch_size=len(CAPTIONS), collate_fn=PackingCollate(MAX_TOKENS))
    swap = AttentionSwap(backend="sdpa", verbose=False)
    L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False,
              callbacks=[swap]).fit(task, loader)  # fmt: skip
    assert (task.losses[0] - alone).abs().max().item() <= 1e-5
