"""Two CPU ranks train with AccumulationScheduler under DDP (or ddp_powersgd).

``--mode target``: a target global batch; each rank writes its parameters, the comm-hook
calls and the history, and (``--save-every N``) checkpoints. ``--mode adaptive``: the
scheduler measures the communication share; ``--slow-comm S`` makes every gradient
all-reduce sleep S seconds first (a slow network), ``--step-delay S`` makes every
micro-batch's compute take S seconds longer (a compute-bound model).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_speedkit import AccumulationScheduler, DDPPowerSGDStrategy, DeepSpeedZeRO2Strategy

DIM = 16
MICRO = 8


def dataset(samples: int, dtype: torch.dtype = torch.float64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, DIM, generator=g, dtype=torch.float64)
    w = torch.randn(DIM, 1, generator=g, dtype=torch.float64)
    return TensorDataset(x.to(dtype), (x @ w).to(dtype))


class Regression(L.LightningModule):
    def __init__(
        self, step_delay: float = 0.0, samples: int = 256, dtype: torch.dtype = torch.float64
    ) -> None:
        super().__init__()
        self.samples, self.dtype_ = samples, dtype
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(DIM, 1).to(dtype)
        self.step_delay = step_delay
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.step_delay:
            time.sleep(self.step_delay)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        """In order: rank r takes samples r, r + 2, ... (Lightning's own sampler shuffles)."""
        data = dataset(self.samples, self.dtype_)
        trainer = self.trainer
        sampler = DistributedSampler(data, trainer.world_size, trainer.global_rank, shuffle=False)
        return DataLoader(data, batch_size=MICRO, sampler=sampler)


class CountingAllReduce:
    """DDP's default all-reduce as a comm hook that counts its calls (and can be slow)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls = 0

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        tensor = bucket.buffer().div_(dist.get_world_size())
        work = dist.all_reduce(tensor, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])


class RegisterHook(L.Callback):
    """Lightning registers ``ddp_comm_hook`` on CUDA only; on CPU the script does it."""

    def __init__(self, hook: CountingAllReduce) -> None:
        self.hook = hook

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a lambda: DDP checks the annotations of what it registers
        model: Any = trainer.strategy.model
        model.register_comm_hook(None, lambda state, bucket: self.hook(state, bucket))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=("target", "adaptive", "plain"), default="target")
    parser.add_argument("--accumulate", type=int, default=1, help="plain Lightning's")
    parser.add_argument(
        "--strategy", choices=("ddp", "ddp_powersgd", "deepspeed", "fsdp_zero2"), default="ddp"
    )
    parser.add_argument("--schedule", type=json.loads, default=None, help='e.g. {"0": 16}')
    parser.add_argument("--target", type=int, default=64)
    parser.add_argument("--max-global-batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=None, help="Trainer's max_epochs")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--slow-comm", type=float, default=0.0)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--save-every", type=int, default=0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    hook = CountingAllReduce(args.slow_comm)
    strategy: Any
    if args.strategy == "ddp_powersgd":
        strategy = DDPPowerSGDStrategy(start_iter=2, start_method="popen")
    elif args.strategy == "deepspeed":
        strategy = DeepSpeedZeRO2Strategy()  # the kit's preset: ZeRO-2 that runs on CPU
    elif args.strategy == "fsdp_zero2":
        strategy = "fsdp_zero2"
    else:
        strategy = DDPStrategy(start_method="popen")
    scheduler: AccumulationScheduler | None = None
    if args.mode == "plain":
        pass
    elif args.schedule:
        schedule = {int(step): batch for step, batch in args.schedule.items()}
        scheduler = AccumulationScheduler(schedule=schedule)
    elif args.mode == "target":
        scheduler = AccumulationScheduler(target_global_batch=args.target)
    else:
        scheduler = AccumulationScheduler(
            adaptive=True, max_global_batch=args.max_global_batch, measure_steps=3
        )
    callbacks: list[L.Callback] = [scheduler] if scheduler is not None else []
    if args.strategy == "ddp":
        callbacks.append(RegisterHook(hook))
    if args.save_every:
        callbacks.append(ModelCheckpoint(args.out / "ckpt", every_n_train_steps=args.save_every,
                                         save_top_k=-1))  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
        max_epochs=args.epochs,
        callbacks=callbacks, enable_checkpointing=bool(args.save_every),
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        accumulate_grad_batches=args.accumulate,
    )  # fmt: skip
    # DeepSpeed's ZeRO optimizer and Lightning's FSDP precision work in fp32 at most
    dtype = torch.float32 if args.strategy in ("deepspeed", "fsdp_zero2") else torch.float64
    model = Regression(args.step_delay, args.samples, dtype)
    trainer.fit(model)

    rank = trainer.global_rank
    # FSDP: the consolidated weights (a collective; rank 0 receives them)
    state = (trainer.strategy.lightning_module_state_dict() if args.strategy == "fsdp_zero2"
             else model.state_dict())  # fmt: skip
    torch.save({k: v.detach().clone() for k, v in state.items()}, args.out / f"params{rank}.pt")
    result = {
        "global_step": trainer.global_step,
        "micro_batches": len(model.losses),
        "hook_calls": getattr(trainer.strategy, "hook_calls", hook.calls),
        "history": [asdict(change) for change in scheduler.history] if scheduler else [],
        "measurements": [asdict(m) for m in scheduler.measurements] if scheduler else [],
        "first_loss": model.losses[0],
        "last_loss": model.losses[-1],
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
