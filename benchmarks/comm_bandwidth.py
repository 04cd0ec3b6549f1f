"""Step time and bytes on the wire: ddp vs ddp_fp16_compress vs ddp_powersgd over a shaped link.

Two ranks run in two Linux network namespaces joined by a veth pair, each as its
own "node" (``num_nodes=2``), so every gradient byte crosses the link. The link
is shaped with ``tc``'s token-bucket filter to each ``--rates`` value. The model
(``--layers`` square linear layers of ``--width``) has enough gradient to make
the step communication-bound. For each rate and strategy it reports the median
step time and the bytes each rank sent per step (the veth's tx counter), and
prints a table and writes JSON.

Needs root (namespaces, tc); installs iproute2 with apt-get when ``ip`` is
missing. All traffic stays between the two namespaces it creates, which are
deleted at the end, also on failure. tc's netem (added delay) is not available
on every kernel, so links are shaped in rate only.

    sudo python benchmarks/comm_bandwidth.py --rates 1gbit 10gbit
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # shared with ddp_buckets.py
from netns_link import VethLink, ensure_iproute2, exit_on_sigterm, interface_bytes

LINK = VethLink("speedkit")
STRATEGIES = ("ddp", "ddp_fp16_compress", "ddp_powersgd")


# --- one rank ------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """Runs inside a namespace: one node of a two-node job."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_speedkit  # noqa: F401  (registers the strategy names)

    torch.set_num_threads(1)
    import faulthandler

    faulthandler.dump_traceback_later(args.stack_after, exit=True)  # a hung rank says where
    rank = args.rank

    class Wide(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                *(torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers))
            )

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.tx: list[int] = []

        def on_train_batch_end(self, *a: Any) -> None:
            self.stamps.append(time.perf_counter())
            self.tx.append(interface_bytes(LINK.interfaces[rank])[0])

    strategy: Any = args.strategy
    if args.strategy == "ddp_powersgd":
        from lightning_speedkit import DDPPowerSGDStrategy

        strategy = DDPPowerSGDStrategy(start_iter=2)
    clock = Clock()
    x = torch.randn(args.batch * (args.steps + 2), args.width)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        callbacks=[clock],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Wide(), DataLoader(TensorDataset(x), batch_size=args.batch))
    skip = args.warmup
    steps = [b - a for a, b in zip(clock.stamps[skip:], clock.stamps[skip + 1 :], strict=False)]
    sent = [b - a for a, b in zip(clock.tx[skip:], clock.tx[skip + 1 :], strict=False)]
    result = {
        "rank": rank,
        "step_ms": 1e3 * statistics.median(steps),
        "bytes_per_step": statistics.median(sent),
    }
    Path(args.out).write_text(json.dumps(result))


def run_pair(args: argparse.Namespace, strategy: str, out_dir: Path) -> list[dict[str, Any]]:
    port = str(29_500 + int(time.time()) % 1000)
    procs = []
    for rank in (0, 1):
        env = LINK.node_env(rank, int(port))
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--rank",
            str(rank),
            "--strategy",
            strategy,
            "--out",
            str(out_dir / f"{strategy}{rank}.json"),
            "--width",
            str(args.width),
            "--layers",
            str(args.layers),
            "--batch",
            str(args.batch),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ]
        cmd = LINK.command(rank, cmd)
        # To files, not pipes: a rank blocked on a full pipe would stall the other in a collective.
        log = open(out_dir / f"{strategy}{rank}.log", "w")  # noqa: SIM115
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    for rank, p in enumerate(procs):
        if p.wait(timeout=args.timeout):
            err = (out_dir / f"{strategy}{rank}.log").read_text()
            raise RuntimeError(f"{strategy}: rank {rank} failed:\n{err[-3000:]}")
    return [json.loads((out_dir / f"{strategy}{r}.json").read_text()) for r in (0, 1)]


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default="benchmarks/results/comm_bandwidth.json")
    parser.add_argument("--stack-after", type=float, default=600, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return None
    if os.geteuid() != 0:
        sys.exit("comm_bandwidth.py creates network namespaces and shapes links: run it as root.")
    ensure_iproute2()
    exit_on_sigterm()
    rows = []
    scratch = Path(args.out).with_suffix(".runs")
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        LINK.create()
        for rate in args.rates:
            LINK.shape(rate)
            for strategy in STRATEGIES:
                ranks = run_pair(args, strategy, scratch)
                rows.append(
                    {
                        "rate": rate,
                        "strategy": strategy,
                        "step_ms": max(r["step_ms"] for r in ranks),
                        "mb_sent_per_step": statistics.fmean(r["bytes_per_step"] for r in ranks)
                        / 2**20,
                    }
                )
                print(
                    f"  {rate:>7} {strategy:<18} {rows[-1]['step_ms']:9.1f} ms "
                    f"{rows[-1]['mb_sent_per_step']:9.2f} MiB/step",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        LINK.delete()
        shutil.rmtree(scratch, ignore_errors=True)
    grad_mib = args.width * args.width * args.layers * 4 / 2**20
    print(
        f"\ntwo ranks, one per network namespace, veth shaped with tc tbf; model {args.layers} x "
        f"{args.width}x{args.width} linear ({grad_mib:.0f} MiB of fp32 gradient), "
        f"batch {args.batch}"
    )
    print(f"{'link':>7}  {'strategy':<18}{'step (ms)':>10}{'MiB sent/step':>15}{'vs ddp':>8}")
    for row in rows:
        base = next(r for r in rows if r["rate"] == row["rate"] and r["strategy"] == "ddp")
        row["speedup_vs_ddp"] = base["step_ms"] / row["step_ms"]
        print(
            f"{row['rate']:>7}  {row['strategy']:<18}{row['step_ms']:>10.1f}"
            f"{row['mb_sent_per_step']:>15.2f}{row['speedup_vs_ddp']:>7.2f}x"
        )
    report = {
        "benchmark": "comm_bandwidth",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            k: str(v) for k, v in vars(args).items() if k not in ("worker", "rank", "strategy")
        },
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
