"""Two CPU ranks train with RegionalCompile, FusedOptimizer and MicroBatchTuner, then resume.

``--strategies A,B`` (``ddp``, ``fsdp_zero2``, ...) run in turn in the same two
processes (they start once). The loader gives micro-batches of 4;
the target global batch is 32. MicroBatchTuner's timing is injected and differs by
rank (rank 0 finds 16 fastest, then 8; rank 1 finds 4 fastest and 16 over its
memory): both ranks must train with 8, rank 0's best of the sizes that fit on both, so
2 micro-batches per optimizer step on 2 ranks, 2 optimizer steps per epoch (64
samples). Under DeepSpeed, where MicroBatchTuner refuses, it is left out.

The script fits 4 steps with a checkpoint at step 2 (an epoch end), then fits again
from that checkpoint in the same processes, and each rank writes, per strategy, both runs' losses,
the micro-batch of each step it trained, what was compiled and switched, and a
checksum of its parameters.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import (
    AccumulationScheduler,
    FusedOptimizer,
    MicroBatchTuner,
    RegionalCompile,
    SpeedMonitor,
)
from lightning_speedkit.compute import StepMeasurement

DIM, GIVEN, GLOBAL, SAMPLES = 16, 4, 32, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Task(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 1)
        self.losses: list[float] = []
        self.sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/loss", loss, batch_size=x.shape[0])
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"].detach()))
        self.sizes.append(int(batch[0].shape[0]))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, DIM, generator=g)
    return DataLoader(TensorDataset(x, torch.sin(x[:, :1])), batch_size=GIVEN)


def timing() -> Any:
    """Rank 0 finds 16 fastest, then 8; rank 1 finds 4 fastest, and 16 over its memory.

    The step runs on every rank (under fsdp_zero2 it communicates: a rank that skipped it
    would leave the other waiting); rank 1's peak at 16 is reported over any limit.
    """

    def measure(run: Any, n: int) -> StepMeasurement:
        rank = dist.get_rank()  # known once fit has started the process group
        rates = {16: 2000.0, 8: 1000.0} if rank == 0 else {4: 1000.0}
        run()
        peak = 2**60 if rank == 1 and n >= 16 else None
        return StepMeasurement(n / rates.get(n, 100.0), peak)

    return measure


def fit(
    args: argparse.Namespace, steps: int, resume: Path | None
) -> tuple[L.Trainer, Task, Any, MicroBatchTuner | None]:
    compile_callback = RegionalCompile(backend="aot_eager", verbose=False)
    callbacks: list[L.Callback] = [
        compile_callback,
        FusedOptimizer(verbose=False),
        AccumulationScheduler(target_global_batch=GLOBAL, verbose=False),
        SpeedMonitor(warmup_steps=1, log_every_n_steps=2),
        ModelCheckpoint(args.out / "ckpt", every_n_train_steps=2, save_top_k=-1),
    ]
    tuner = None
    if not args.strategy.startswith("deepspeed"):  # where MicroBatchTuner refuses
        tuner = MicroBatchTuner(measure=timing(), verbose=False)
        callbacks.insert(1, tuner)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=args.strategy, max_steps=steps, logger=False,
        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    task = Task()
    trainer.fit(task, loader(), ckpt_path=resume)
    return trainer, task, compile_callback, tuner


def _result(tuner: MicroBatchTuner | None) -> Any:
    if tuner is None or tuner.result is None:
        return None
    table = {row["micro_batch"]: row["skipped"] for row in tuner.result.table}
    return {"best": tuner.result.best["batch_size"], "table": table}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategies", required=True, help="comma-separated, run in turn")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    rank = 0
    for strategy in args.strategies.split(","):
        run = argparse.Namespace(**{**vars(args), "strategy": strategy,
                                    "out": args.out / strategy})  # fmt: skip
        straight, task, compiled, tuner = fit(run, steps=4, resume=None)
        rank = straight.global_rank
        ckpt = run.out / "ckpt" / "epoch=0-step=2.ckpt"
        resumed, resumed_task, _, resumed_tuner = fit(run, steps=4, resume=ckpt)
        fused = [s.implementation for c in straight.callbacks if isinstance(c, FusedOptimizer)
                 for s in c.switched]  # fmt: skip
        results[strategy] = {
            "global_step": resumed.global_step,
            "losses": task.losses,
            "resumed_losses": resumed_task.losses,
            "sizes": task.sizes,
            "resumed_sizes": resumed_task.sizes,
            "compiled": compiled.compiled,
            "graphs": compiled.watch.graphs,
            "fused": fused,
            "checksum": float(sum(p.detach().double().sum() for p in resumed_task.parameters())),
            "tuned": _result(tuner),
            "resumed_tuned": _result(resumed_tuner),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(results))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
