"""Two CPU ranks fit a linear regression with a communication-compressing strategy.

Each rank writes, from inside the training processes (so any launcher works):
hook calls, PowerSGD iteration and compression ratio, losses, and its final
parameters (``params{rank}.pt``). ``--save-every N`` checkpoints every N
steps; ``--resume`` continues from a checkpoint.

``--measure-memory`` also records the most bytes torch's CPU tensors held at once
(torch's allocation records, from before the model is built) and whether DDP rebuilt
its buckets; ``--strategy ddp_view`` is Lightning's own
``DDPStrategy(gradient_as_bucket_view=True)``, beside the kit's strategies.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import DDPHalfPrecisionStrategy, DDPPowerSGDStrategy

DIM = 64


class Regression(L.LightningModule):
    def __init__(self, width: int = DIM, depth: int = 2, optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            *[torch.nn.Linear(width, width, bias=False) for _ in range(depth)]
        )
        self.optimizer = optimizer
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def data(samples: int, width: int = DIM) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, width, generator=g)
    target = torch.randn(width, width, generator=g) / width**0.5
    return DataLoader(TensorDataset(x, x @ target), batch_size=16, shuffle=False)


def peak_tensor_bytes(prof: torch.profiler.profile) -> int:
    """The most bytes this process's CPU tensors held at once while ``prof`` recorded."""
    records = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    held = peak = 0
    for _, nbytes in records:
        held += nbytes
        peak = max(peak, held)
    return peak


class Report(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.extra: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        state = getattr(strategy, "powersgd_state", None)
        rank = trainer.global_rank
        # no copy: the memory peak is measured up to here
        torch.save(pl_module.state_dict(), self.out / f"params{rank}.pt")
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
            "ddp_kwargs": {k: v for k, v in getattr(strategy, "_ddp_kwargs", {}).items()
                           if isinstance(v, (bool, int, float))},
            "released_before_rebuild": getattr(strategy, "released_before_rebuild", None),
            "kept_views_in_no_sync": getattr(strategy, "kept_views_in_no_sync", None),
            "rebuilt_buckets": getattr(strategy.model, "_has_rebuilt_buckets", None),
            "n_params": sum(p.numel() for p in pl_module.parameters()),
        }  # fmt: skip
        self.result = result
        if self.extra.get("defer"):  # written after fit, with the memory peak
            return
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
    parser.add_argument("--gradient-as-bucket-view", type=int, choices=(0, 1), default=None)
    parser.add_argument("--static-graph", action="store_true")
    parser.add_argument("--rank", type=int, default=1, help="PowerSGD's rank")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--width", type=int, default=DIM)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--measure-memory", action="store_true")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--warm-start", type=int, choices=(0, 1), default=1)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    start = {"subprocess": "popen", "spawn": "spawn", "fork": "fork"}[args.launcher]
    strategy: Any
    ddp: dict[str, Any] = {"start_method": start, "bucket_cap_mb": args.bucket_cap_mb}
    if args.gradient_as_bucket_view is not None:
        ddp["gradient_as_bucket_view"] = bool(args.gradient_as_bucket_view)
    if args.static_graph:
        ddp["static_graph"] = True
    if args.measure_memory:
        # Every rank builds the same weights (seed 0); without DDP's initial broadcast,
        # whose buffer gloo sometimes frees on its own threads, where torch's allocation
        # records do not see it (one rank in ten then counted it for the whole run).
        ddp["init_sync"] = False
    if args.strategy == "ddp_powersgd":
        strategy = DDPPowerSGDStrategy(rank=args.rank, start_iter=args.start_iter,
                                       warm_start=bool(args.warm_start), **ddp)  # fmt: skip
    elif args.strategy in ("ddp_fp16_compress", "ddp_bf16_compress"):
        strategy = DDPHalfPrecisionStrategy(args.strategy[4:8], **ddp)
    elif args.strategy == "ddp_view":
        strategy = L.pytorch.strategies.DDPStrategy(gradient_as_bucket_view=True, **ddp)
    else:
        strategy = L.pytorch.strategies.DDPStrategy(start_method=start)
    report = Report(args.out)
    report.extra["defer"] = args.measure_memory
    callbacks: list[L.Callback] = [report]
    if args.save_every:  # every rank takes part: the PowerSGD state is gathered
        callbacks.append(ModelCheckpoint(args.out / "ckpt", every_n_train_steps=args.save_every,
                                         save_top_k=-1))  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps,
        accumulate_grad_batches=args.accumulate, logger=False, callbacks=callbacks,
        enable_checkpointing=bool(args.save_every), enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    # The profiler records every allocation and free of a CPU tensor made on this thread
    # (the hooks measured here free nothing on gloo's own threads).
    tracker = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )
    with (
        tracker if args.measure_memory else contextlib.nullcontext(),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        task = Regression(args.width, args.depth, args.optimizer)
        trainer.fit(task, data(args.samples, args.width), ckpt_path=args.resume)
    if args.measure_memory:
        result = {**report.result, "peak_bytes": peak_tensor_bytes(tracker)}
        result["warnings"] = [str(w.message) for w in caught]
        (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
