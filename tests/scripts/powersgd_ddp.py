"""Two CPU ranks fit a linear regression with a communication-compressing strategy.

Each rank writes, from inside the training processes (so any launcher works):
hook calls, PowerSGD iteration and compression ratio, losses, and its final
parameters (``params{rank}.pt``). ``--save-every N`` checkpoints every N
steps; ``--resume`` continues from a checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import DDPHalfPrecisionStrategy, DDPPowerSGDStrategy

DIM = 64


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, DIM, bias=False),
                                       torch.nn.Linear(DIM, DIM, bias=False))  # fmt: skip
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def data(samples: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, DIM, generator=g)
    target = torch.randn(DIM, DIM, generator=g) / DIM**0.5
    return DataLoader(TensorDataset(x, x @ target), batch_size=16, shuffle=False)


class Report(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        state = getattr(strategy, "powersgd_state", None)
        rank = trainer.global_rank
        torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                   self.out / f"params{rank}.pt")  # fmt: skip
        result = {
            "strategy": type(strategy).__name__,
            "launcher": type(strategy.launcher).__name__ if strategy.launcher else None,
            "hook_calls": getattr(strategy, "hook_calls", 0),
            "global_step": trainer.global_step,
            "powersgd_iter": state.iter if state is not None else None,
            "ratio": (state.total_numel_before_compression / state.total_numel_after_compression
                      if state is not None and state.total_numel_after_compression else None),
            "first_loss": pl_module.losses[0] if pl_module.losses else None,
            "last_loss": sum(pl_module.losses[-5:]) / max(1, len(pl_module.losses[-5:])),
            "losses": pl_module.losses,
        }  # fmt: skip
        # Written here, inside the rank, so that spawn and fork launchers report too.
        (self.out / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", default="ddp_powersgd")
    parser.add_argument("--launcher", choices=("subprocess", "spawn", "fork"), default="subprocess")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples", type=int, default=192)  # 6 steps an epoch on 2 ranks
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--start-iter", type=int, default=2)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--resume", type=Path, default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    start = {"subprocess": "popen", "spawn": "spawn", "fork": "fork"}[args.launcher]
    strategy: Any
    if args.strategy == "ddp_powersgd":
        strategy = DDPPowerSGDStrategy(start_iter=args.start_iter, start_method=start,
                                       bucket_cap_mb=args.bucket_cap_mb)  # fmt: skip
    elif args.strategy in ("ddp_fp16_compress", "ddp_bf16_compress"):
        strategy = DDPHalfPrecisionStrategy(args.strategy[4:8], start_method=start)
    else:
        strategy = L.pytorch.strategies.DDPStrategy(start_method=start)
    callbacks: list[L.Callback] = [Report(args.out)]
    if args.save_every:  # every rank takes part: the PowerSGD state is gathered
        callbacks.append(ModelCheckpoint(args.out / "ckpt", every_n_train_steps=args.save_every,
                                         save_top_k=-1))  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps,
        accumulate_grad_batches=args.accumulate, logger=False, callbacks=callbacks,
        enable_checkpointing=bool(args.save_every), enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Regression(), data(args.samples), ckpt_path=args.resume)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
