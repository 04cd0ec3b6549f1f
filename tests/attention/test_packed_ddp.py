"""Packed batches under DDP (two CPU processes, gloo): each rank keeps its documents apart,
and the fit's steps are those of one process running every document alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_speedkit import swap_attention

from ..helpers.multiprocess import run_script

STEPS, BATCH_SIZE, MAX_TOKENS, LR, VOCAB = 3, 6, 12, 1e-2, 50


def samples() -> list[dict[str, Tensor]]:
    """Two ranks' worth of documents, 1 to 8 tokens each."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 9, (2 * STEPS * BATCH_SIZE,), generator=g).tolist()
    return [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g),
             "labels": torch.randint(0, VOCAB, (n,), generator=g)} for n in lengths]  # fmt: skip


@pytest.mark.multiprocess
def test_ddp_ranks_train_packed_as_one_process_runs_each_document_alone(tmp_path: Path) -> None:
    from .test_packed_compiled import Decoder

    ranks = run_script("packed_ddp.py", tmp_path)
    assert [r["packed"] for r in ranks] == [[True] * STEPS] * 2
    torch.manual_seed(0)
    model = Decoder()  # the ranks' initial weights
    swap_attention(model, "sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    data = samples()
    for step in range(STEPS):
        means = []
        for rank, result in enumerate(ranks):
            # rank r trains on samples r, r + 2, ... (the script's train_dataloader)
            mine = data[rank::2][step * BATCH_SIZE : (step + 1) * BATCH_SIZE]
            alone = torch.cat([F.cross_entropy(model(s["input_ids"][None])[0], s["labels"],
                                               reduction="none") for s in mine])  # fmt: skip
            packed = torch.tensor(result["losses"][step])
            assert packed.shape == alone.shape
            assert (packed - alone.detach()).abs().max().item() <= 1e-5, (step, rank)
            means.append(alone.mean())
        optimizer.zero_grad()
        (sum(means) / 2).backward()  # DDP averages the ranks' gradients
        optimizer.step()
