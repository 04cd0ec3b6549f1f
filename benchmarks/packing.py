"""Padding against bucketing against packing, on a causal LM with long-tailed lengths.

A nanoGPT-style decoder (eager causal attention, which ``AttentionSwap("sdpa")`` swaps in
every arm, so all of them run the same fused kernel; ``--backend`` picks another) trains
on a synthetic corpus whose lengths are long-tailed as instruction data is: log-normal,
median about a quarter of the longest. The documents follow a fixed sparse bigram chain,
so the loss really falls. Each arm trains one epoch over the same documents,
``--docs-per-step`` of them per step (so the same tokens per step, on average):

- ``padded``: the documents in a shuffled order, padded to the longest of the batch
  (plain ``pad_sequence``);
- ``bucketed``: the kit's ``LengthBucketBatchSampler`` (pools sorted by length), padded
  to the longest of the batch;
- ``packed``: the same batches as ``padded``, packed by ``PackingCollate`` into rows of
  ``--max-len``; AttentionSwap runs the attention per document (no model code changed:
  even the learned positions, ``wpe(torch.arange(T))``, restart per document);
- ``packed_ffd``: as ``packed``, with ``PackingCollate(first_fit=True)``: each batch's
  documents placed longest first, each into the first row with room (first-fit
  decreasing), where ``packed`` fills rows in the order the documents come.

Every document arrives as (input, label) pairs shifted inside it, so the loss (the mean
over label tokens) is over the same tokens in every arm, and ``padded`` and ``packed``
see exactly the same tokens in every step: their loss curves must agree to rounding.

Arms run in interleaved rounds (rotated order), each a fresh ``Trainer.fit`` from the
same seed; the table gives medians over rounds. Tokens/s are real tokens (padding left
out), as ``SpeedMonitor`` reports them (start-up steps and its FLOP-count step left
out). The padding share is of the positions the model ran over, from the batches.
The attention share is the attention operators' share of the step in a
``ProfilerSchedule`` window (one short profiled fit per arm, outside the timed rounds).

    python benchmarks/packing.py

On a GPU, FlexAttention with a document mask (one call over the packed rows, where
``sdpa`` runs one call per document), at a size a GPU is not idle on::

    python benchmarks/packing.py --accelerator gpu --precision bf16-mixed --backend flex \
        --dim 512 --layers 8 --heads 8 --max-len 2048

CUDA's time is SpeedMonitor's (CUDA events, read at log time); the losses are read to
the host once the fit ends, so no step waits for the device. On CPU the timing is as it
was before these options.

Prints a table and writes JSON (``--out``), after every fit with ``"complete": false``
and the rates so far (a run cut off by a time limit keeps them), then whole.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import statistics
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

from lightning_speedkit import AttentionSwap, ProfilerSchedule, SpeedMonitor
from lightning_speedkit.attention.backends import BACKENDS
from lightning_speedkit.data import LengthBucketBatchSampler, PackingCollate

HERE = Path(__file__).resolve()
ARMS = ("padded", "bucketed", "packed", "packed_ffd")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


# --- the corpus --------------------------------------------------------------------------


def corpus(n: int, max_len: int, vocab: int, seed: int = 0) -> list[Tensor]:
    """``n`` documents of ``max_len + 1`` tokens at most (input and label pairs: ``max_len``),
    log-normal lengths with median ``max_len / 4``, drawn from a sparse bigram chain."""
    g = torch.Generator().manual_seed(seed)
    sigma = math.log(4) / 2.1  # the longest (max_len) about the 98th percentile
    lengths = torch.exp(math.log(max_len / 4) + sigma * torch.randn(n, generator=g))
    lengths = lengths.round().clamp(8, max_len).long()
    successors = torch.randint(0, vocab, (vocab, 4), generator=g).tolist()  # 4 next ones each
    docs = []
    for length in lengths.tolist():
        tokens = [int(torch.randint(0, vocab, (1,), generator=g))]
        for pick in torch.randint(0, 4, (length,), generator=g).tolist():
            tokens.append(successors[tokens[-1]][pick])
        docs.append(torch.tensor(tokens))
    return docs


class Documents(torch.utils.data.Dataset[dict[str, Tensor]]):
    def __init__(self, docs: list[Tensor]) -> None:
        self.docs = docs

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        doc = self.docs[i]
        return {"input_ids": doc[:-1], "labels": doc[1:]}


def pad_collate(samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Pads to the batch's longest: input 0, labels -100, and the attention mask."""
    ids = pad_sequence([s["input_ids"] for s in samples], batch_first=True)
    labels = pad_sequence([s["labels"] for s in samples], batch_first=True, padding_value=-100)
    mask = pad_sequence([torch.ones_like(s["input_ids"]) for s in samples], batch_first=True)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def batches(arm: str, lengths: list[int], per_step: int, capacity: int) -> list[list[int]]:
    """The epoch's batches of document indices for ``arm`` (the same for every round)."""
    if arm == "bucketed":
        return list(LengthBucketBatchSampler(lengths, batch_size=per_step, seed=0))
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).tolist()
    steps = [order[i : i + per_step] for i in range(0, len(order), per_step)]
    return steps


def loader(arm: str, data: Documents, args: argparse.Namespace) -> DataLoader[Any]:
    lengths = [len(d) - 1 for d in data.docs]
    packed = arm.startswith("packed")
    first_fit = arm == "packed_ffd"
    collate = (
        PackingCollate(max_tokens=args.max_len, first_fit=first_fit) if packed else pad_collate
    )
    return DataLoader(data, batch_sampler=batches(arm, lengths, args.docs_per_step, args.max_len),
                      collate_fn=collate, num_workers=0)  # fmt: skip


def padding_share(arm: str, data: Documents, args: argparse.Namespace) -> float:
    """Share of the positions the model runs over that are padding, over the epoch."""
    real = positions = 0
    for batch in loader(arm, data, args):
        real += int((batch["labels"] != -100).sum())
        positions += batch["input_ids"].numel()
    return 1 - real / positions


# --- the model ---------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, written out (explicit matmul, mask and softmax)."""

    def __init__(self, dim: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        mask = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        self.register_buffer("bias", mask)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, dim: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), CausalSelfAttention(dim, n_head, block_size)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT: token and learned position embeddings, blocks, a final norm and head."""

    def __init__(self, vocab: int, dim: int, layers: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block_size, dim)
        self.h = nn.ModuleList(Block(dim, n_head, block_size) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class LM(L.LightningModule):
    """Next-token loss: the mean over label tokens (-100: padding, never a loss)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.model = GPT(args.vocab, args.dim, args.layers, args.heads, args.max_len)
        self.losses: list[Tensor] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self.model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        self.losses.append(loss.detach())  # the curve, read once the fit ends: no step waits
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


# --- one fit -----------------------------------------------------------------------------


def fit(arm: str, data: Documents, args: argparse.Namespace, profile: bool = False) -> Any:
    """One arm's epoch from seed 0: SpeedMonitor's summary, the losses and the kernels the
    swapped attention ran, or with ``profile`` a ProfilerSchedule window's attention share."""
    L.seed_everything(0, verbose=False)
    task = LM(args)
    monitor = SpeedMonitor(peak_flops=None, warmup_steps=args.warmup, max_flop_counts=1)
    swap = AttentionSwap(args.backend, measure=False, verbose=False)
    callbacks: list[L.Callback] = [swap]
    with tempfile.TemporaryDirectory() as traces:
        profiler = ProfilerSchedule(skip_first=args.warmup, wait=0, warmup=1, active=3,
                                    dirpath=traces, with_stack=False)  # fmt: skip
        callbacks.append(profiler if profile else monitor)
        trainer = L.Trainer(
            accelerator=args.accelerator, devices=1, precision=args.precision, max_epochs=1,
            logger=False,
            max_steps=args.warmup + 4 if profile else -1, callbacks=callbacks,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(task, loader(arm, data, args))
        if profile:
            report = profiler.report
            return None if report is None else report.breakdown.get("attention", 0.0)
    # SYNC: the losses to the host, once, after the fit (never inside a step)
    losses = torch.stack(task.losses).float().tolist() if task.losses else []
    return {"summary": monitor.summary, "losses": losses, "attention": kernels(swap)}


def kernels(swap: AttentionSwap) -> dict[str, Any]:
    """What the swapped modules ran (a backend the device lacks: its fallback, said so),
    and how many were reverted to their own attention, with why (a reverted module
    attends across the documents of a packed row)."""
    modules = swap.report.modules if swap.report is not None else []
    return {
        "backends": sorted({m.backend or "-" for m in modules if m.status != "reverted"}),
        "swapped": sum(m.status != "reverted" for m in modules),
        "reverted": sum(m.status == "reverted" for m in modules),
        "reasons": sorted({m.reason for m in modules if m.status == "reverted"}),
    }


def curve(losses: list[float], points: int = 5) -> list[float]:
    """The loss at ``points`` places of the run, each the mean of its stretch of steps."""
    size = max(1, len(losses) // points)
    return [statistics.fmean(losses[i : i + size]) for i in range(0, size * points, size)]


def measure(args: argparse.Namespace, progress: Any = None) -> dict[str, Any]:
    """The arms' rows; ``progress(arm, round, tokens_per_sec)`` after every fit."""
    docs = corpus(args.docs_per_step * args.steps, args.max_len, args.vocab, seed=args.seed)
    data = Documents(docs)
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]:
            runs[arm].append(fit(arm, data, args))
            rate = runs[arm][-1]["summary"]["tokens_per_sec"]
            print(f"round {r + 1}/{args.rounds} {arm}: {rate:.0f} tokens/s", flush=True)
            if progress is not None:
                progress(arm, r, rate)
    rows = [_row(arm, runs[arm], data, args) for arm in ARMS]
    base = {row["arm"]: row["tokens_per_sec"] for row in rows}
    padded = rows[0]["losses"]
    for row in rows:
        row["x_padded"] = row["tokens_per_sec"] / base["padded"]
        row["x_bucketed"] = row["tokens_per_sec"] / base["bucketed"]
        # the same documents in every step as padded: the same loss, to rounding
        same = row["arm"] != "bucketed"
        gaps = [abs(a - b) for a, b in zip(padded, row["losses"], strict=True)]
        row["loss_gap_to_padded"] = max(gaps) if same else None
    lengths = [len(d) - 1 for d in docs]
    return {
        "rows": rows,
        "documents": len(docs),
        "real_tokens": sum(lengths),
        "length_median": statistics.median(lengths),
        "length_max": max(lengths),
    }


def _row(
    arm: str, runs: list[dict[str, Any]], data: Documents, args: argparse.Namespace
) -> dict[str, Any]:
    rates = [run["summary"]["tokens_per_sec"] for run in runs]
    losses = runs[-1]["losses"]
    return {
        "arm": arm,
        "tokens_per_sec": statistics.median(rates),
        "tokens_per_sec_rounds": rates,
        "step_ms_p50": statistics.median(run["summary"]["step_ms_p50"] for run in runs),
        "padding_share": padding_share(arm, data, args),
        "attention_share": fit(arm, data, args, profile=True),
        "attention_kernels": runs[-1]["attention"],
        "loss_curve": curve(losses),
        "losses": losses,
    }


def _table(report: dict[str, Any]) -> None:
    print(f"\n{report['device']}, {report['precision']}, AttentionSwap({report['backend']!r})")
    for row in report["rows"]:
        ran = row["attention_kernels"]
        reverted = f"; {ran['reverted']} reverted ({'; '.join(ran['reasons'])})"
        print(f"  {row['arm']}: {ran['swapped']} module(s) on {', '.join(ran['backends']) or '-'}"
              + (reverted if ran["reverted"] else ""))  # fmt: skip
    print(f"{'arm':<11} {'tokens/s':>9} {'x padded':>9} {'x bucketed':>11} {'step p50 ms':>12} "
          f"{'padding':>8} {'attention':>10}  loss curve (5 stretches)")  # fmt: skip
    for row in report["rows"]:
        attention = "-" if row["attention_share"] is None else f"{row['attention_share']:.1%}"
        losses = " ".join(f"{x:.3f}" for x in row["loss_curve"])
        print(f"{row['arm']:<11} {row['tokens_per_sec']:>9.0f} {row['x_padded']:>9.2f} "
              f"{row['x_bucketed']:>11.2f} {row['step_ms_p50']:>12.1f} "
              f"{row['padding_share']:>8.1%} {attention:>10}  {losses}")  # fmt: skip
    gaps = ", ".join(f"{row['arm']} {row['loss_gap_to_padded']:.1e}" for row in report["rows"][2:])
    print(f"largest per-step loss gap to padded (same tokens each step): {gaps}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps of each arm's epoch")
    parser.add_argument("--docs-per-step", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512, help="longest document, packed row")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="the corpus's")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu", "cuda"))
    parser.add_argument("--precision", default="32-true", choices=PRECISIONS)
    parser.add_argument("--backend", default="sdpa", choices=("auto", *BACKENDS),
                        help="AttentionSwap's, every arm (flex: one FlexAttention call with "
                        "a document mask on a packed batch; CUDA only in training)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=HERE.parent / "results" / "packing.json")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup + 1 or args.rounds < 1 or args.max_len < 8:
        parser.error("need --steps > --warmup + 1, --rounds >= 1 and --max-len >= 8")
    if args.accelerator != "cpu" and not torch.cuda.is_available():
        parser.error(f"--accelerator {args.accelerator} needs a CUDA device; torch sees none")
    torch.set_num_threads(args.threads)
    for name in ("lightning", "lightning.pytorch", "lightning_speedkit"):
        logging.getLogger(name).setLevel(logging.WARNING)  # one fit per arm and round: quiet
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} thread(s), "
        f"torch {torch.__version__}",
        "device": device_name(args.accelerator),
        "torch": torch.__version__,
        "precision": args.precision,
        "backend": args.backend,
        "load_average_at_start": load,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "complete": False,
        "progress": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def progress(arm: str, round_: int, rate: float) -> None:
        report["progress"].append({"round": round_, "arm": arm, "tokens_per_sec": rate})
        args.out.write_text(json.dumps(report, indent=2) + "\n")  # what a time limit keeps

    report.update(measure(args, progress), complete=True)
    report["load_average_at_end"] = list(os.getloadavg()) if load is not None else None
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    _table(report)
    return report


def device_name(accelerator: str) -> str:
    """The device the steps ran on: the GPU's name, or ``"cpu"``."""
    return torch.cuda.get_device_name(0) if accelerator != "cpu" else "cpu"


if __name__ == "__main__":
    main()
