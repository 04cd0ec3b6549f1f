"""Step time by DDP's ``bucket_cap_mb`` over a shaped link, for ``ddp`` and ``ddp_fp16_compress``.

DDP all-reduces gradients in buckets of about ``bucket_cap_mb`` MiB, each sent as
soon as all its gradients are ready, so that communication overlaps the rest of
the backward pass. Small buckets start sending earlier but pay a collective's
fixed cost many times; large ones pay it once and overlap less. This benchmark
measures what that trade is worth over a link of known rate.

Two ranks run in two Linux network namespaces joined by a veth pair, each as its
own "node" (``num_nodes=2``), so every gradient byte crosses the link, which tc's
token-bucket filter shapes to each ``--rates`` value (``benchmarks/netns_link.py``).
The model is a stack of ``--layers`` linear layers of ``--width`` (16 x 1024 by
default: 16.8 M parameters, 64 MiB of fp32 gradient, and about as much backward
compute on one CPU thread as a 10 Gbit/s link takes to carry it). For each rate,
both processes train every (strategy, bucket size) cell in turn, ``--rounds``
times with the cells in a rotating order (this machine is shared and noisy);
a cell's step time is the median over its measured steps (``--warmup`` steps of
every run excluded: the first iteration, and DDP's bucket rebuild after it), the
slower rank's. Bytes sent are the veth's tx counter per step. Prints a table and
writes JSON (``--out``).

    python benchmarks/ddp_buckets.py            # 1 and 10 Gbit/s, buckets 1 5 25 100 MiB
    python benchmarks/ddp_buckets.py --quick    # one rate, a small model, two bucket sizes

Needs root (namespaces, tc); installs iproute2 with apt-get when ``ip`` is
missing. All traffic stays between the two namespaces it creates, which are
deleted at the end, also on failure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # shared with comm_bandwidth.py
from netns_link import VethLink, ensure_iproute2, exit_on_sigterm, interface_bytes

HERE = Path(__file__).resolve()
LINK = VethLink("skbucket", subnet="10.234.0")
STRATEGIES = ("ddp", "ddp_fp16_compress")
QUICK = {
    "rates": ["10gbit"],
    "buckets": [1.0, 25.0],
    "width": 256,
    "layers": 4,
    "batch": 8,
    "steps": 3,
    "warmup": 1,
    "rounds": 1,
}


def cell_order(cells: list[tuple[str, float]], rounds: int) -> list[tuple[str, float]]:
    """Every cell once per round, each round starting one cell later (no cell always first)."""
    order = []
    for r in range(rounds):
        shift = r % len(cells)
        order += cells[shift:] + cells[:shift]
    return order


def _median_after(values: list[float], warmup: int) -> float:
    if len(values) <= warmup:
        raise ValueError(f"{len(values)} steps recorded, {warmup} of them warm-up: nothing left")
    return statistics.median(values[warmup:])


# --- one rank ------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    """Runs inside a namespace: one node of a two-node job, every cell of one rate."""
    import faulthandler

    import lightning as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_speedkit import DDPHalfPrecisionStrategy

    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(args.stack_after, exit=True)  # a hung rank says where
    interface = os.environ["GLOO_SOCKET_IFNAME"]

    class Stack(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            layers = [(torch.nn.Linear(args.width, args.width), torch.nn.ReLU())
                      for _ in range(args.layers)]  # fmt: skip
            self.net = torch.nn.Sequential(*itertools.chain.from_iterable(layers))

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-6)

    class Clock(L.Callback):
        """Host time and interface bytes at the end of every step (no device work on CPU)."""

        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.sent: list[int] = []
            self.buckets = 0
            self.bucket_view = False

        def on_train_batch_start(self, trainer: L.Trainer, *a: Any) -> None:
            if not self.stamps:  # the first step's start: what the first duration counts from
                self.stamps.append(time.perf_counter())
                self.sent.append(interface_bytes(interface)[0])

        def on_train_batch_end(self, trainer: L.Trainer, *a: Any) -> None:
            self.stamps.append(time.perf_counter())
            self.sent.append(interface_bytes(interface)[0])

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            ddp = trainer.strategy.model
            data = ddp._get_ddp_logging_data()  # type: ignore[union-attr, operator]
            sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
            self.buckets = len(str(sizes).split(","))
            self.bucket_view = bool(ddp.gradient_as_bucket_view)  # type: ignore[union-attr]

    steps = args.warmup + args.steps
    x = torch.randn(args.batch * steps, args.width)

    def train(strategy_name: str, cap: float) -> tuple[list[float], list[float], Clock]:
        """One run: step times (ms), bytes sent per step, and the clock (DDP's settings)."""
        strategy: Any
        if strategy_name == "ddp":
            strategy = DDPStrategy(bucket_cap_mb=cap)
        else:
            strategy = DDPHalfPrecisionStrategy("fp16", bucket_cap_mb=cap)
        clock = Clock()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_steps=steps,
            logger=False, callbacks=[clock], enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(Stack(), DataLoader(TensorDataset(x), batch_size=args.batch))
        step_ms = [1e3 * (b - a) for a, b in itertools.pairwise(clock.stamps)]
        sent = [float(b - a) for a, b in itertools.pairwise(clock.sent)]
        return step_ms, sent, clock

    def compute_only() -> list[float]:
        """The same steps with no communication at all: what the link adds to."""
        model = Stack()
        optimizer = model.configure_optimizers()
        step_ms = []
        for i in range(steps):
            start = time.perf_counter()
            model.training_step([x[i * args.batch : (i + 1) * args.batch]], i).backward()
            optimizer.step()
            optimizer.zero_grad()
            step_ms.append(1e3 * (time.perf_counter() - start))
        return step_ms

    cells = [(s, b) for s in STRATEGIES for b in args.buckets]
    measured: dict[str, dict[str, Any]] = {}
    compute_ms: list[float] = []
    for strategy_name, cap in cell_order(cells, args.rounds):
        step_ms, sent, clock = train(strategy_name, cap)
        cell = measured.setdefault(f"{strategy_name}@{cap:g}", {
            "strategy": strategy_name, "bucket_cap_mb": cap, "step_ms": [], "round_ms": [],
            "bytes_per_step": [], "buckets": clock.buckets,
            "gradient_as_bucket_view": clock.bucket_view,
        })  # fmt: skip
        cell["step_ms"] += step_ms[args.warmup :]
        cell["round_ms"].append(_median_after(step_ms, args.warmup))
        cell["bytes_per_step"] += sent[args.warmup :]
        if (strategy_name, cap) == cells[-1]:  # once a round, between two runs
            compute_ms += compute_only()[args.warmup :]
    result = {"rank": args.rank, "cells": list(measured.values()), "compute_ms": compute_ms,
              "threads": torch.get_num_threads()}  # fmt: skip
    Path(args.out).write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# --- the two nodes -------------------------------------------------------------------------


def run_rate(args: argparse.Namespace, rate: str, scratch: Path) -> list[dict[str, Any]]:
    """Both nodes, every cell, at one link rate; what each rank measured."""
    procs = []
    port = 29_500 + args.rates.index(rate)  # a fresh port for every launch
    for rank in (0, 1):
        out = scratch / f"{rate}-{rank}.json"
        cmd = [sys.executable, str(HERE), "--worker", "--rank", str(rank), "--out", str(out),
               "--buckets", *map(str, args.buckets), "--width", str(args.width), "--layers",
               str(args.layers), "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--rounds", str(args.rounds),
               "--stack-after", str(args.timeout)]  # fmt: skip
        # To files, not pipes: a rank blocked on a full pipe would stall the other in a collective.
        log = open(scratch / f"{rate}-{rank}.log", "w")  # noqa: SIM115
        # One thread per rank: both "nodes" share this machine's cores. Lightning would set
        # cpu_count // devices threads in a process launched from outside (when
        # OMP_NUM_THREADS is unset), overriding torch.set_num_threads(1).
        env = {**LINK.node_env(rank, port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(LINK.command(rank, cmd), env=env, stdout=log,
                                      stderr=subprocess.STDOUT))  # fmt: skip
    try:
        for rank, p in enumerate(procs):
            if p.wait(timeout=args.timeout):
                err = (scratch / f"{rate}-{rank}.log").read_text()
                raise RuntimeError(f"{rate}: rank {rank} failed:\n{err[-3000:]}")
    finally:
        for p in procs:  # the other rank, when one failed (``ip netns exec`` runs it as p.pid)
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads((scratch / f"{rate}-{r}.json").read_text()) for r in (0, 1)]


def summarize(rate: str, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell: the slower rank's median step, bytes sent, against bucket_cap_mb=25."""
    rows = []
    for cells in zip(*(r["cells"] for r in ranks), strict=True):
        first = cells[0]
        rows.append({
            "rate": rate,
            "strategy": first["strategy"],
            "bucket_cap_mb": first["bucket_cap_mb"],
            "buckets": first["buckets"],
            "gradient_as_bucket_view": first.get("gradient_as_bucket_view"),
            "step_ms": max(statistics.median(c["step_ms"]) for c in cells),
            "round_ms": [max(ms) for ms in zip(*(c["round_ms"] for c in cells), strict=True)],
            "mib_sent_per_step": statistics.fmean(
                statistics.median(c["bytes_per_step"]) for c in cells) / 2**20,
        })  # fmt: skip
    rows.sort(key=lambda r: (STRATEGIES.index(r["strategy"]), r["bucket_cap_mb"]))
    for row in rows:
        default = [r for r in rows if r["strategy"] == row["strategy"] and r["bucket_cap_mb"] == 25]
        row["vs_25mb"] = default[0]["step_ms"] / row["step_ms"] if default else None
    return rows


def compute_only_ms(ranks: list[dict[str, Any]]) -> float:
    """The slower rank's median step without communication: the floor under every cell."""
    return max(statistics.median(r["compute_ms"]) for r in ranks)


def table(rows: list[dict[str, Any]], compute: dict[str, float]) -> str:
    """The rows as a text table, one line per cell, then each rate's compute-only step."""
    lines = [f"{'link':>7}  {'strategy':<18}{'bucket MiB':>11}{'buckets':>8}{'step (ms)':>11}"
             f"{'rounds (ms)':>22}{'MiB sent/step':>15}{'vs 25 MiB':>10}"]  # fmt: skip
    for r in rows:
        rounds = "/".join(f"{ms:.0f}" for ms in r["round_ms"])
        versus = f"{r['vs_25mb']:.2f}x" if r["vs_25mb"] else "-"
        lines.append(
            f"{r['rate']:>7}  {r['strategy']:<18}{r['bucket_cap_mb']:>11g}{r['buckets']:>8}"
            f"{r['step_ms']:>11.1f}{rounds:>22}{r['mib_sent_per_step']:>15.2f}{versus:>10}"
        )
    for rate, ms in compute.items():
        lines.append(f"{rate:>7}  {'(compute only)':<18}{'-':>11}{'-':>8}{ms:>11.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    parser.add_argument("--buckets", type=float, nargs="+", default=[1.0, 5.0, 25.0, 100.0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps of each run not measured")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a small check: " + str(QUICK))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default=str(HERE.parent / "results" / "ddp_buckets.json"))
    parser.add_argument("--stack-after", type=float, default=1800, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return None
    if args.quick:
        vars(args).update(QUICK)
    for flag in ("steps", "rounds", "width", "layers", "batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the first step builds DDP's buckets")
    if any(b <= 0 for b in args.buckets):
        parser.error(f"--buckets must be positive sizes in MiB, got {args.buckets}")
    if os.geteuid() != 0:
        sys.exit("ddp_buckets.py creates network namespaces and shapes links: run it as root.")
    ensure_iproute2()
    exit_on_sigterm()
    rows: list[dict[str, Any]] = []
    compute: dict[str, float] = {}
    threads: set[int] = set()
    scratch = Path(args.out).with_suffix(".runs")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        LINK.create()
        for rate in args.rates:
            LINK.shape(rate)
            ranks = run_rate(args, rate, scratch)
            rows += summarize(rate, ranks)
            compute[rate] = compute_only_ms(ranks)
            threads |= {r["threads"] for r in ranks}
            mine = [r for r in rows if r["rate"] == rate]
            print(table(mine, {rate: compute[rate]}), file=sys.stderr, flush=True)
    finally:
        LINK.delete()
        shutil.rmtree(scratch, ignore_errors=True)

    import lightning
    import torch

    params = args.layers * (args.width * args.width + args.width)
    print(
        f"\ntwo ranks, one per network namespace, veth shaped with tc tbf; {args.layers} x "
        f"Linear({args.width}, {args.width}) ({params / 1e6:.1f} M parameters, "
        f"{4 * params / 2**20:.0f} MiB of fp32 gradient), batch {args.batch}, 1 thread per rank; "
        f"median of {args.rounds} x {args.steps} steps after {args.warmup} warm-up"
    )
    print(table(rows, compute))
    report = {
        "benchmark": "ddp_buckets",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "rank", "out")},
        "model": {
            "layers": args.layers,
            "width": args.width,
            "parameters": params,
            "grad_mib": 4 * params / 2**20,
        },
        "rows": rows,
        "compute_only_ms": compute,
        "threads_per_rank": sorted(threads),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
