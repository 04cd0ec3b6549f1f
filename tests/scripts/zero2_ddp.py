"""Two CPU ranks train a small block model with a ZeRO-2 preset (``--strategy NAME``).

An epoch is 4 steps (64 samples, 2 ranks, micro-batches of 8), so a checkpoint every
4 steps falls on an epoch end and a resumed run sees the same data as an unbroken one.
``--accelerator``, ``--devices`` and ``--precision`` go to the Trainer (default: two
CPU processes in fp32).

Each rank writes its losses, global step, the bytes of optimizer state it holds and
its parameters. ``--save-every N`` checkpoints every N steps; ``--resume PATH`` goes on
from a checkpoint (a file, or DeepSpeed's directory).
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
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_speedkit import ActivationCheckpointing, ProfilerSchedule  # registers strategies

DIM, BLOCKS, MICRO = 32, 4, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def dataset(samples: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, DIM, generator=g)
    return TensorDataset(x, torch.sin(x[:, :1]) + x[:, 1:2] * x[:, 2:3])


class Task(L.LightningModule):
    def __init__(self, sgd: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()
        self.losses: list[float] = []
        self.sgd = sgd

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        if self.sgd:  # the step is the gradient itself: its scale shows
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        data = dataset()
        trainer = self.trainer
        sampler = DistributedSampler(data, trainer.world_size, trainer.global_rank, shuffle=False)
        return DataLoader(data, batch_size=MICRO, sampler=sampler)


def local(value: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (FSDP2's states are DTensors: numel() is the whole)."""
    return value.to_local() if isinstance(value, DTensor) else value


def optimizer_state_bytes(trainer: L.Trainer) -> int:
    optimizer: Any = trainer.optimizers[0]
    while not isinstance(optimizer, torch.optim.Optimizer):  # DeepSpeed's ZeRO wrapper
        optimizer = optimizer.optimizer
    return sum(
        local(value).numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--checkpointing", action="store_true", help="ActivationCheckpointing")
    parser.add_argument("--profile", action="store_true", help="ProfilerSchedule, one window")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--sgd", action="store_true", help="plain SGD instead of AdamW")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    callbacks: list[L.Callback] = []
    profiler = None
    if args.profile:
        profiler = ProfilerSchedule(skip_first=1, wait=0, warmup=1, active=2, repeat=1,
                                    dirpath=args.out / "profiler")  # fmt: skip
        callbacks.append(profiler)
    checkpointing = ActivationCheckpointing() if args.checkpointing else None
    if checkpointing is not None:
        callbacks.append(checkpointing)
    if args.save_every:
        callbacks.append(ModelCheckpoint(args.out / "ckpt", every_n_train_steps=args.save_every,
                                         save_top_k=-1))  # fmt: skip
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, precision=args.precision,
        strategy=args.strategy, max_steps=args.steps,
        logger=False, callbacks=callbacks, enable_checkpointing=bool(args.save_every),
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        accumulate_grad_batches=args.accumulate,
    )  # fmt: skip
    task = Task(sgd=args.sgd)
    trainer.fit(task, ckpt_path=args.resume)
    rank = trainer.global_rank
    n_params = sum(p.numel() for p in Task().parameters())
    result = {
        "strategy": type(trainer.strategy).__name__,
        "global_step": trainer.global_step,
        "losses": task.losses,
        "optimizer_state_bytes": optimizer_state_bytes(trainer),
        "unsharded_adam_bytes": 2 * 4 * n_params,  # exp_avg and exp_avg_sq, fp32
        "blocks": [k.__name__ for k in getattr(trainer.strategy, "blocks", [])],
        "checkpointed": checkpointing.checkpointed if checkpointing is not None else [],
        "traces": [str(p) for p in profiler.traces] if profiler is not None else [],
    }
    if args.sgd:  # how far each weight moved (DDP and DeepSpeed's ZeRO-2 keep them whole)
        result["moved"] = [
            float(value)
            for after, before in zip(task.parameters(), Task().parameters(), strict=True)
            for value in (after.detach().float().cpu() - before).flatten()[:64]
        ]
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
