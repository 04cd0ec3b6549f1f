"""AttentionSwap on a Hugging Face model sharded by FSDP2 (``fsdp2_zero2``).

The swapped module there is the whole model (family ``huggingface``), which holds the
FSDP2 units (its decoder layers); the embedding and head are the root unit's. A parity
check with a backward would end in FSDP2's end-of-backward callback, which reshards the
root in the middle of its forward: the check runs forward only there.
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_speedkit import swap_attention
from lightning_speedkit.distributed import apply_fsdp2_zero2
from tests.helpers.hf_tiny import tiny_model
from tests.helpers.multiprocess import run_script

pytest.importorskip("transformers")

LLAMA = tiny_model("LlamaConfig", "LlamaForCausalLM", vocab_size=64, hidden_size=32,
                   intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64,
                   tie_word_embeddings=True, attn_implementation="eager")  # fmt: skip


class _Task(nn.Module):
    """A LightningModule's shape: the Llama inside, a step method that runs it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = LLAMA()

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


@pytest.fixture
def one_rank() -> Any:
    """A gloo process group of one rank in this process (an in-memory store, no port)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    gc.collect()  # the FSDP model's reference cycles hold the group: finalize them here


@pytest.mark.usefixtures("one_rank")
def test_swap_checks_forward_only_and_trains_like_the_plain_model_under_fsdp2() -> None:
    plain = _Task()
    sharded = copy.deepcopy(plain)
    report = swap_attention(sharded, "sdpa", measure=False)
    assert apply_fsdp2_zero2(sharded, forward_methods=["step"]) == [
        "model.model.layers.0",
        "model.model.layers.1",
    ]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, sharded)]
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(3, 64, (4, 16), generator=generator)
        losses = []
        for model, optimizer in zip((plain, sharded), optimizers, strict=True):
            loss = model.step(ids)  # the first sharded one: the check, inside the root's forward
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    (entry,) = report.modules
    assert (entry.family, entry.status, entry.checked) == ("huggingface", "active", "forward")


@pytest.mark.multiprocess
def test_fsdp2_zero2_ranks_swap_a_hugging_face_model_and_train_like_ddp(tmp_path: Path) -> None:
    sharded = run_script("attention_swap_fsdp2.py", tmp_path / "fsdp2", "--strategy", "fsdp2_zero2")
    ddp = run_script("attention_swap_fsdp2.py", tmp_path / "ddp", "--strategy", "ddp")
    for rank in range(2):
        (entry,) = sharded[rank]["report"]["modules"]
        assert (entry["family"], entry["status"]) == ("huggingface", "active"), entry
        assert entry["checked"] == "forward"  # no backward in the check under FSDP2
        assert sharded[rank]["running"] == ["model"]  # still swapped at the end
        assert ddp[rank]["report"]["modules"][0]["checked"] == "forward+backward"
        assert len(sharded[rank]["losses"]) == 3
        assert sharded[rank]["losses"] == pytest.approx(ddp[rank]["losses"], rel=1e-5)
