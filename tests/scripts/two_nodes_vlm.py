"""One "node" of a two-node job: the tiny example VLM with ``ddp_powersgd``, one process.

Started once per node by tests/distributed/test_two_nodes.py, inside that node's
network namespace, with the environment a cluster launcher gives (Lightning's
variables, or torchrun's): ``Trainer(num_nodes=2, devices=1)``. Each rank writes
``rank{R}.json`` (steps, per-step losses, PowerSGD's iteration and compression
ratio, the cluster environment Lightning chose, the bytes its network interface
sent and received, per step) and ``params{R}.pt`` (the trained weights).
``--save-every N`` checkpoints every N steps; ``--resume`` continues from one.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_speedkit import DDPPowerSGDStrategy
from speedkit_examples.vlm import CaptionTokenizer, CorpusConfig, VLMConfig, VLMDataModule, VLMTask

#: 96 training samples, 12 per rank per step on two ranks: 4 steps an epoch.
CORPUS = CorpusConfig(train_samples=96, val_samples=32, samples_per_shard=32)
BATCH = 12


def _interface_bytes() -> tuple[int, int]:
    """(sent, received) by the interface gloo uses, seen from this node's namespace."""
    stats = Path("/sys/class/net") / os.environ["GLOO_SOCKET_IFNAME"] / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


class Report(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[float] = []
        self.wire: list[tuple[int, int]] = []  # interface (tx, rx) at the end of each step

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.wire.append(_interface_bytes())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any
    ) -> None:
        self.losses.append(float(outputs["loss"]))  # CPU tensor: no device sync
        self.wire.append(_interface_bytes())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, DDPPowerSGDStrategy)
        state = strategy.powersgd_state
        rank = trainer.global_rank
        torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                   self.out / f"params{rank}.pt")  # fmt: skip
        ratio = None  # elements before over after compression, over the run
        if state is not None and state.total_numel_after_compression:
            ratio = state.total_numel_before_compression / state.total_numel_after_compression
        result = {
            "global_rank": rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "environment": type(strategy.cluster_environment).__name__,
            "main_address": strategy.cluster_environment.main_address,  # type: ignore[union-attr]
            "backend": torch.distributed.get_backend(),
            "global_step": trainer.global_step,
            "losses": self.losses,
            "wire": self.wire,
            "hook_calls": strategy.hook_calls,
            "powersgd_iter": state.iter if state is not None else None,
            "ratio": ratio,
            "grad_bytes": sum(4 * p.numel() for p in pl_module.parameters() if p.requires_grad),
        }
        (self.out / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--start-iter", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--resume", type=Path, default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # two processes on two cores

    L.seed_everything(0, verbose=False)
    tokenizer = CaptionTokenizer()
    cfg = VLMConfig.preset("tiny", tokenizer.vocab_size)
    task = VLMTask(cfg, pad_id=tokenizer.pad_id)
    data = VLMDataModule.for_model(cfg, args.data_dir, batch_size=BATCH, corpus=CORPUS,
                                   progress=False)  # fmt: skip
    report = Report(args.out)
    callbacks: list[L.Callback] = [report]
    if args.save_every:
        callbacks.append(ModelCheckpoint(args.out / "ckpt", every_n_train_steps=args.save_every,
                                         save_top_k=-1))  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", num_nodes=2, devices=1,
        strategy=DDPPowerSGDStrategy(rank=4, start_iter=args.start_iter), max_steps=args.steps,
        limit_val_batches=0, logger=False, callbacks=callbacks,
        enable_checkpointing=bool(args.save_every), enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(task, datamodule=data, ckpt_path=args.resume)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
