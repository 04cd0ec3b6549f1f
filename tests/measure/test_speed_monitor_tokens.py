"""SpeedMonitor on padded and packed batches: real tokens per second, and the FLOPs of the
per-document attention that ran. Exact figures, no wall clock."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap, SpeedkitConfigError, SpeedMonitor
from lightning_speedkit.data import PackingCollate
from lightning_speedkit.measure import _clock
from lightning_speedkit.measure._batch_info import BatchReader, real_tokens
from lightning_speedkit.measure._throughput import Throughput
from tests.helpers.clock import VirtualClock

from ..helpers import models

VOCAB, DIM, HEADS, MAX_TOKENS = 50, 32, 4, 12
LENGTHS = (5, 3, 7, 2, 4, 6)  # rows of 12: [5, 3 | pad 4], [7, 2 | pad 3], [4, 6 | pad 2]
STEP = 0.25  # seconds, on the virtual clock


def _packed() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, VOCAB, (n + 1,), generator=g) for n in LENGTHS]
    # labels shifted inside each document: no pair crosses a boundary when packed
    samples = [{"input_ids": d[:-1], "labels": d[1:]} for d in docs]
    return PackingCollate(max_tokens=MAX_TOKENS)(samples)


def test_a_packed_batch_counts_documents_and_the_tokens_they_hold() -> None:
    batch = _packed()
    info = BatchReader().read(batch, [batch])
    assert (info.samples, info.tokens) == (6, 3 * MAX_TOKENS)  # documents; positions
    assert isinstance(info.real_tokens, Tensor)  # reduced on the batch's device, unread
    assert int(info.real_tokens) == sum(LENGTHS) == 27
    del batch["document_ids"]  # cu_seqlens alone says it too
    assert int(BatchReader().read(batch, [batch]).real_tokens) == 27


@pytest.mark.parametrize(
    "wrap",
    [
        lambda b: (b["input_ids"], b["labels"], {k: b[k] for k in ("cu_seqlens", "document_ids")}),
        lambda b: {"inputs": b},
        lambda b: [b],
    ],
    ids=["tuple-with-dict", "nested-dict", "list"],
)
def test_packing_fields_held_deeper_in_the_batch_count_as_at_its_top(wrap: Any) -> None:
    """AttentionSwap keeps such a batch's documents apart; SpeedMonitor read only the top
    level and counted it as unpacked: rows as samples, padding as tokens."""
    batch = _packed()
    info = BatchReader().read(wrap(batch), [wrap(batch)])
    assert (info.samples, int(info.real_tokens)) == (6, 27)
    assert info.first_packed


def test_an_attention_mask_gives_the_real_tokens_and_labels_are_not_read() -> None:
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = (ids > 0).long()
    assert int(real_tokens({"input_ids": ids, "attention_mask": mask}, [ids, mask])) == 5
    # -100 labels mark what the loss ignores (padding, or a prompt the model still ran)
    labels = torch.tensor([[-100, 6, 7, -100], [-100, 9, -100, -100]])
    assert real_tokens({"input_ids": ids, "labels": labels}, [ids, labels]) == 8
    assert real_tokens(ids, [ids]) == 8  # no mapping, nothing marks padding: every position


def test_pads_a_packed_batch_kept_inside_its_documents_are_not_counted() -> None:
    """Samples packed by hand with their own padding: ``document_ids`` covers the pads,
    the ``attention_mask`` says which they are."""
    documents = torch.tensor([[0, 0, 0, 1, 1, -1]])
    mask = torch.tensor([[1, 1, 0, 1, 1, 0]])
    ids = torch.tensor([[5, 6, 0, 8, 9, 0]])
    batch = {"input_ids": ids, "document_ids": documents, "attention_mask": mask}
    assert int(real_tokens(batch, [ids])) == 4


def test_loaders_of_a_step_add_their_real_tokens() -> None:
    packed = _packed()
    ids = torch.zeros(2, 5, dtype=torch.long)
    padded = {"input_ids": ids, "attention_mask": torch.tensor([[1] * 5, [1, 1, 0, 0, 0]])}
    info = BatchReader().read({"a": packed, "b": padded}, [packed, padded])
    assert (info.samples, info.tokens, int(info.real_tokens)) == (6 + 2, 36 + 10, 27 + 7)


def test_hugging_faces_names_count_the_documents_and_their_tokens() -> None:
    """transformers' ``DataCollatorWithFlattening`` names our fields ``cu_seq_lens_q`` and
    ``seq_idx``: read alike, each alone too."""
    ours = _packed()
    batch = {k: v for k, v in ours.items() if k not in ("cu_seqlens", "document_ids")}
    renamed = {**batch, "cu_seq_lens_q": ours["cu_seqlens"], "seq_idx": ours["document_ids"]}
    for fields in (("cu_seq_lens_q", "seq_idx"), ("cu_seq_lens_q",), ("seq_idx",)):
        part = {**batch, **{f: renamed[f] for f in fields}}
        info = BatchReader().read(part, [part])
        assert (info.samples, info.tokens) == (6, 3 * MAX_TOKENS), fields
        assert isinstance(info.real_tokens, Tensor), fields
        assert int(info.real_tokens) == 27, fields
    only_ids = {**batch, "document_ids": ours["document_ids"]}  # ours, without cu_seqlens
    assert BatchReader().read(only_ids, [only_ids]).samples == 6


def _spelled(value: Tensor, spelling: str) -> Any:
    return {"list": value.tolist(), "numpy": value.numpy(), "(1, n)": value[None]}[spelling]


@pytest.mark.parametrize("spelling", ["list", "numpy"])
@pytest.mark.parametrize("name", ["document_ids", "seq_idx"])
def test_document_ids_of_any_spelling_count_as_the_tensors_do(name: str, spelling: str) -> None:
    """A collate of one's own (or transformers' with ``return_tensors="np"``) gives the
    ids as a list or an array: AttentionSwap keeps those documents apart, and SpeedMonitor
    counted every row as a sample and the padding as tokens (3 and 36, not 6 and 27)."""
    ours = _packed()
    batch = {k: v for k, v in ours.items() if k not in ("cu_seqlens", "document_ids")}
    tensor = {**batch, name: ours["document_ids"]}
    spelled = {**batch, name: _spelled(ours["document_ids"], spelling)}
    counts = []
    for each in (tensor, spelled):
        info = BatchReader().read(each, [each])
        counts.append((info.samples, info.tokens, int(info.real_tokens)))
    assert counts == [(6, 36, 27)] * 2


@pytest.mark.parametrize("spelling", ["list", "numpy", "(1, n)"])
@pytest.mark.parametrize("name", ["cu_seqlens", "cu_seq_lens_q"])
def test_cu_seqlens_of_any_spelling_count_as_the_tensor_does(name: str, spelling: str) -> None:
    """One row packed ahead of time, which a ``DataLoader`` stacks into ``(1, n)``
    ``cu_seqlens``; or offsets a collate of one's own left as a list or an array."""
    lengths = (5, 3, 7)
    row = {"input_ids": torch.ones(1, sum(lengths), dtype=torch.long)}
    offsets = torch.tensor([0, 5, 8, 15], dtype=torch.int32)
    counts = []
    for each in ({**row, name: offsets}, {**row, name: _spelled(offsets, spelling)}):
        info = BatchReader().read(each, [each])
        counts.append((info.samples, info.tokens, int(info.real_tokens)))
    assert counts == [(3, 15, 15)] * 2


def test_packing_fields_that_hold_no_integers_are_refused_as_attentionswap_does() -> None:
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long), "document_ids": [[0.0, 0.5, 1, 1]]}
    with pytest.raises(SpeedkitConfigError, match="`document_ids` must hold integers"):
        BatchReader().read(batch, [batch])


def test_a_flattened_row_counts_a_document_where_its_positions_restart() -> None:
    lengths = (5, 3, 1, 7, 1)  # documents of one token restart at once
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = torch.ones_like(positions)
    batch = {"input_ids": ids, "labels": ids, "position_ids": positions}
    info = BatchReader().read(batch, [batch])
    assert (info.samples, info.tokens, info.real_tokens) == (5, 17, 17)  # no padding
    batch["position_ids"] = positions + 2  # positions counted from 2 (RoBERTa's)
    assert BatchReader().read(batch, [batch]).samples == 5
    plain = {"input_ids": ids, "position_ids": torch.arange(17)[None]}  # one sample
    assert BatchReader().read(plain, [plain]).samples == 1
    rows = {"input_ids": ids.view(1, 17).expand(2, 17), "position_ids": positions.expand(2, 17)}
    assert BatchReader().read(rows, [rows]).samples == 2  # rows, not one flattened row


@pytest.mark.parametrize(
    "options",
    [{}, {"return_seq_idx": True}, {"return_flash_attn_kwargs": True},
     {"return_flash_attn_kwargs": True, "return_seq_idx": True}],
)  # fmt: skip
def test_transformers_flattening_collator_counts_its_documents(options: dict[str, bool]) -> None:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DataCollatorWithFlattening"):
        pytest.skip("this transformers has no DataCollatorWithFlattening")
    g = torch.Generator().manual_seed(0)
    features = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()}
                for n in LENGTHS]  # fmt: skip
    batch = transformers.DataCollatorWithFlattening(**options)(features)
    assert batch["input_ids"].shape == (1, sum(LENGTHS))  # one row, no padding
    info = BatchReader().read(batch, [batch])
    assert (info.samples, info.tokens, int(info.real_tokens)) == (6, 27, 27)


def test_tokens_on_the_device_are_read_once_when_the_interval_closes() -> None:
    throughput = Throughput(window=10)
    throughput.update(samples=6, tokens=torch.tensor(27), flops=None)
    throughput.update(samples=4, tokens=13, flops=None)  # a number where nothing was padded
    throughput.update(samples=6, tokens=torch.tensor(20, dtype=torch.int32), flops=None)
    row = throughput.close(step_times=[0.5, 0.25, 0.25], waits=[0.0] * 3, mem_gib=0.0)
    throughput.add([row])
    figures = throughput.compute([row], peak=None)
    assert figures["tokens_per_sec"] == 60.0  # (27 + 13 + 20) tokens in 1 s
    assert figures["samples_per_sec"] == 16.0
    empty = throughput.close(step_times=[0.5], waits=[0.0], mem_gib=0.0)
    assert empty[1] == 0.0  # the read tensors are not counted again


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, written eagerly: what AttentionSwap swaps."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head = HEADS
        self.c_attn, self.c_proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.register_buffer("bias", torch.tril(torch.ones(MAX_TOKENS, MAX_TOKENS))[None, None])

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (k.size(-1) ** 0.5))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class TinyGPT(nn.Module):
    """One nanoGPT attention layer; learned positions from ``torch.arange`` (the kit
    restarts them per document)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(MAX_TOKENS, DIM)
        self.attn = CausalSelfAttention()
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        return self.lm_head(x + self.attn(x))


class Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt = TinyGPT()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        models._sleep(STEP)
        logits = self.gpt(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    clock = VirtualClock()
    monkeypatch.setattr(_clock, "_host_time", clock)
    monkeypatch.setattr(models, "_sleep", clock.sleep)
    return clock


def _fit(steps: int, swap: bool) -> SpeedMonitor:
    monitor = SpeedMonitor(peak_flops=None, warmup_steps=0)
    batch = _packed()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, log_every_n_steps=4,
        callbacks=[monitor, *([AttentionSwap("sdpa", measure=False)] if swap else [])],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Task(), DataLoader([batch] * steps, batch_size=None))
    return monitor


def test_tokens_per_sec_counts_the_packed_documents_not_the_padding(
    virtual_clock: VirtualClock,
) -> None:
    summary = _fit(steps=8, swap=False).summary
    assert summary["tokens_per_sec"] == pytest.approx(27 / STEP, rel=1e-12)  # 36 with padding
    assert summary["samples_per_sec"] == pytest.approx(6 / STEP, rel=1e-12)  # documents


def _linear_flops(positions: int) -> int:
    """Forward and both backward products of every Linear (its input needs a gradient)."""
    return 6 * positions * (DIM * 3 * DIM + DIM * DIM + DIM * VOCAB)


def _attention_flops(lengths: list[int]) -> int:
    """Model FLOPs of SDPA on documents of these lengths: forward (QK^T and PV, 2 FLOPs
    a multiply-add: 4 B H L^2 D) and backward twice that."""
    return sum(3 * 4 * HEADS * n * n * (DIM // HEADS) for n in lengths)


def test_the_count_sees_the_per_document_attention_that_ran(virtual_clock: VirtualClock) -> None:
    """AttentionSwap runs SDPA per document (equal lengths stacked): the counter prices each
    of those calls, each span's padding included, not the whole rows."""
    monitor = _fit(steps=6, swap=True)
    (counted,) = monitor.flops.counted.values()
    spans = [5, 3, 4, 7, 2, 3, 4, 6, 2]  # what each row is cut into, padding spans included
    assert counted.model == _linear_flops(36) + _attention_flops(spans)
    assert counted.model < _linear_flops(36) + _attention_flops([MAX_TOKENS] * 3)
    assert counted.tokens == 36  # the FLOP fit goes by positions: linear layers run padding


@pytest.mark.gpu
def test_real_tokens_of_packed_batches_cost_the_hooks_no_sync() -> None:
    """The count is a reduction left on the device: the hooks still never wait for it."""

    class SyncOn(L.Callback):  # before the monitor's batch-start hook
        def on_train_batch_start(self, *args: Any) -> None:
            torch.cuda.set_sync_debug_mode("error")

    class SyncOff(L.Callback):  # after the monitor's batch-end hook
        def on_train_batch_end(self, *args: Any) -> None:
            torch.cuda.set_sync_debug_mode("default")

    class Plain(Task):
        def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
            ids = batch["input_ids"]
            x = self.gpt.wte(ids) + self.gpt.wpe(torch.arange(ids.shape[1], device=ids.device))
            logits = self.gpt.lm_head(x)  # no attention: the guard watches the monitor only
            return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    monitor = SpeedMonitor(peak_flops=None, warmup_steps=0, flops_per_batch=lambda b: 0)
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_steps=8, logger=False, log_every_n_steps=100,
        callbacks=[SyncOn(), monitor, SyncOff()], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Plain(), DataLoader([_packed()] * 8, batch_size=None))
    # read once, at the end of training (no log inside the guarded steps)
    assert monitor._throughput.run[0][1] == 27 * 7  # real tokens of the 7 timed steps
