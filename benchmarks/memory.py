"""Per-rank peak memory under ddp, the kit's DDP, fsdp_zero2, fsdp2_zero2 and deepspeed_zero2.

Part 1 trains the example VLM (``base``, 290 M parameters, AdamW, fp32 on CPU or
bf16-mixed on CUDA) for a few steps on two processes under each strategy, with and
without ActivationCheckpointing, and records each rank's peak memory: on CUDA
``torch.cuda.max_memory_allocated``; on CPU the same quantity from torch's own
allocation records (the profiler's memory events, from before the model is built: the
peak of the bytes its tensors held; a tensor freed on one of gloo's threads leaves no
record and counts until its address is allocated again, see ``_peak_held``), and
beside it the process's peak resident set
(VmHWM) above what it held at the start, which adds libraries and allocator slack. The
plan's prediction is ``plan_memory(..., device=...).per_device(name)`` with the VLM's
two towers' activations: the higher of its forward/backward and optimizer-step peaks.
Images are 112 pixels and captions 32 tokens, so a CPU step takes seconds: model
states dominate there.

The DDP rows: ``ddp`` is Lightning's ``strategy="ddp"`` as users write it (DDP's
buckets beside the gradients), planned with ``gradient_as_bucket_view=False``;
``ddp_powersgd`` is the kit's DDP (gradients as bucket views, the first buckets freed
before DDP lays out new ones), planned with ``gradient_as_bucket_view=True``. It runs
before PowerSGD starts (``start_iter`` 100, past the run's steps): all-reduces in place,
as ``ddp_fp16_compress`` would without its half-precision copy of each bucket, which
gloo frees on its own threads, where torch's CPU allocation records do not see it.
``--static-graph`` passes ``static_graph=True`` to the kit's DDP. Both DDP rows seed
the model and skip DDP's initial broadcast (``init_sync=False``): gloo sometimes frees
its buffer on its own threads, and the records would count it for the whole run.

Part 2 is the activation side on one process (``small`` preset, batch 32): bytes
autograd saves for backward with and without checkpointing, and the median step time
of each, interleaved (the compute that checkpointing costs).

    python benchmarks/memory.py                        # CPU, two gloo processes
    python benchmarks/memory.py --accelerator cuda     # two GPUs

Prints tables and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve()
STRATEGIES = ("ddp", "ddp_powersgd", "fsdp_zero2", "fsdp2_zero2", "deepspeed_zero2")
GIB = 2**30
#: Each benchmarked strategy: the plan's row for it, and whether DDP's gradients are
#: views into its buckets (None: not DDP).
PLANNED: dict[str, tuple[str, bool | None]] = {
    "ddp": ("ddp", False), "ddp_powersgd": ("ddp", True), "fsdp_zero2": ("fsdp_zero2", None),
    "fsdp2_zero2": ("fsdp2_zero2", None), "deepspeed_zero2": ("deepspeed_zero2", None),
}  # fmt: skip


# --- process memory ------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _memory_records(prof: torch.profiler.profile) -> list[tuple[int, int]]:
    """``(bytes, address)`` of each CPU tensor allocation (+) and free (-) ``prof`` recorded,
    in time order (the addresses are in the profiler's trace, not in its event objects)."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    memory = [e for e in events if e.get("name") == "[memory]"
              and e["args"].get("Device Type") == 0]  # fmt: skip
    memory.sort(key=lambda e: e["ts"])  # stable: ties keep the trace's order
    return [(int(e["args"]["Bytes"]), int(e["args"]["Addr"])) for e in memory]


def _peak_held(records: list[tuple[int, int]]) -> int:
    """The most bytes held at once, from ``(bytes, address)`` allocations and frees.

    The profiler records what the profiled thread allocates and frees. A tensor freed
    on another thread (gloo frees some of FSDP's and DDP's communication buffers on its
    own) leaves no record, so a plain running sum would count it for the rest of the
    run. Its address tells: a block whose address is allocated again was freed by
    then, and counts until that moment, at most.

    Example::

        >>> _peak_held([(100, 1), (50, 2), (-50, 2), (100, 1), (-100, 1)])  # 1 reused
        150
    """
    live: dict[int, int] = {}
    held = peak = 0
    for nbytes, address in records:
        if nbytes > 0:
            held += nbytes - live.pop(address, 0)
            live[address] = nbytes
        else:
            held -= live.pop(address, -nbytes)
        peak = max(peak, held)
    return peak


def _peak_tensor_bytes(prof: torch.profiler.profile) -> int:
    """The most bytes torch's CPU tensors held at once while ``prof`` recorded memory."""
    return _peak_held(_memory_records(prof))


# --- part 1: one strategy on two processes (the worker) --------------------------------------


def vlm_config(size: str, image_size: int, text_len: int) -> Any:
    from speedkit_examples.vlm import CaptionTokenizer, VLMConfig

    config = VLMConfig.preset(size, CaptionTokenizer().vocab_size)  # type: ignore[arg-type]
    return replace(config, image_size=image_size, max_text_len=text_len)


def vlm_activations(config: Any, batch: int, bytes_per_value: int, recompute: bool) -> int:
    """Korthikanti et al.'s estimate, tower by tower (eager attention)."""
    from lightning_speedkit.distributed.plan_memory import activation_bytes

    image = config.num_image_tokens
    towers = [
        (image, config.vision_dim, config.vision_depth, config.vision_heads),
        (image + config.max_text_len - 1, config.text_dim, config.text_depth, config.text_heads),
    ]
    return sum(
        activation_bytes(
            batch, s, h, layers, heads, bytes_per_value=bytes_per_value, recompute=recompute
        )
        for s, h, layers, heads in towers
    )


def worker(args: argparse.Namespace) -> None:
    baseline_kib = _status_kib("VmRSS")
    _reset_peak_rss()
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, Dataset

    from lightning_speedkit import ActivationCheckpointing, DDPPowerSGDStrategy
    from speedkit_examples.vlm import VLMTask

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)  # the same weights on every rank
    config = vlm_config(args.size, args.image_size, args.text_len)

    class Synthetic(Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            return {
                "images": torch.randn(3, config.image_size, config.image_size, generator=g),
                "input_ids": torch.randint(
                    4, config.vocab_size, (config.max_text_len,), generator=g
                ),
            }

    steps: list[float] = []

    class Measure(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            steps.append(time.perf_counter() - self.start)

    cuda = args.accelerator == "cuda"
    strategy: Any = args.strategy
    if args.strategy == "ddp":  # Lightning's "ddp" (see the docstring for init_sync)
        strategy = DDPStrategy(init_sync=False)
    elif args.strategy == "ddp_powersgd":  # rank 4: what AdamW needs; PowerSGD not started
        strategy = DDPPowerSGDStrategy(rank=4, start_iter=max(100, args.steps + 1),
                                       static_graph=args.static_graph, init_sync=False)  # fmt: skip
    callbacks: list[L.Callback] = [Measure()]
    if args.checkpointing:
        callbacks.append(ActivationCheckpointing(verbose=False))
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy, max_steps=args.steps,
        precision="bf16-mixed" if cuda else "32-true", logger=False, callbacks=callbacks,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0,
    )  # fmt: skip
    # On CPU torch keeps no allocation statistics; its profiler records every allocation
    # and free of a CPU tensor (a few percent on the step time, the same for all rows).
    tracker = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )
    with contextlib.nullcontext() if cuda else tracker:
        task = VLMTask(config, pad_id=0)
        trainer.fit(task, DataLoader(Synthetic(), batch_size=args.batch))
    result: dict[str, Any] = {"rank": trainer.global_rank, "step_s": statistics.median(steps)}
    if cuda:
        result["peak_bytes"] = torch.cuda.max_memory_allocated()
    else:
        result["peak_bytes"] = _peak_tensor_bytes(tracker)
        result["rss_peak_bytes"] = (_status_kib("VmHWM") - baseline_kib) * 1024
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def run_strategy(args: argparse.Namespace, strategy: str, checkpointing: bool) -> dict[str, Any]:
    out = Path(args.work) / f"{strategy}{'-ckpt' if checkpointing else ''}"
    for stale in out.glob("rank*.json"):
        stale.unlink()
    cmd = [sys.executable, str(HERE), "--worker", "--strategy", strategy, "--out", str(out),
           "--accelerator", args.accelerator, "--size", args.size, "--steps", str(args.steps),
           "--image-size", str(args.image_size), "--text-len", str(args.text_len),
           "--batch", str(args.batch), "--devices", str(args.devices)]  # fmt: skip
    cmd += ["--checkpointing"] if checkpointing else []
    cmd += ["--static-graph"] if args.static_graph else []
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if proc.returncode != 0 and len(ranks) < args.devices:
        raise RuntimeError(f"{strategy} failed:\n{proc.stderr[-4000:]}")
    return {"strategy": strategy, "checkpointing": checkpointing, "ranks": ranks}


def part1(args: argparse.Namespace) -> list[dict[str, Any]]:
    from lightning_speedkit import plan_memory
    from speedkit_examples.vlm import VLM

    config = vlm_config(args.size, args.image_size, args.text_len)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in VLM(config).parameters())
    cuda = args.accelerator == "cuda"
    rows = []
    for strategy in args.strategies:
        row_name, bucket_view = PLANNED[strategy]
        plan = plan_memory(n_params, args.devices, optimizer="adamw",
                           precision="mixed" if cuda else "fp32", device=args.accelerator,
                           gradient_as_bucket_view=bool(bucket_view))  # fmt: skip
        for checkpointing in (False, True):
            run = run_strategy(args, strategy, checkpointing)
            acts = vlm_activations(config, args.batch, 2 if cuda else 4, checkpointing)
            estimate = replace(plan.per_device(row_name), activations=acts)
            planned = estimate.total
            peak = max(r["peak_bytes"] for r in run["ranks"])
            run.update({"plan": row_name, "gradient_as_bucket_view": bucket_view,
                        "static_graph": args.static_graph if bucket_view else None,
                        "n_params": n_params, "planned_bytes": planned,
                        "planned_phase": "step" if estimate.step_peak >= estimate.compute_peak
                        else "forward/backward",
                        "planned_model_states": estimate.model_states,
                        "planned_step_temporaries": estimate.transient,
                        "planned_compute_temporaries": estimate.compute_transient,
                        "planned_buckets": estimate.buckets,
                        "planned_activations": acts, "measured_bytes": peak,
                        "ratio": peak / planned,
                        "step_s": max(r["step_s"] for r in run["ranks"])})  # fmt: skip
            if not cuda:
                run["rss_bytes"] = max(r["rss_peak_bytes"] for r in run["ranks"])
            rows.append(run)
            print(
                f"  {strategy:<16} ckpt={checkpointing!s:<5} measured {peak / GIB:6.2f} GiB, "
                f"planned {planned / GIB:6.2f} GiB ({run['planned_phase']})",
                flush=True,
            )
    return rows


# --- part 2: activations and the compute checkpointing costs (one process) -----------------


def saved_bytes(model: torch.nn.Module, images: torch.Tensor, ids: torch.Tensor) -> int:
    from lightning_speedkit.distributed import saved_tensor_bytes

    def loss() -> torch.Tensor:
        logits = model(images, ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    return saved_tensor_bytes(loss)


def part2(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_speedkit.distributed import checkpoint_blocks
    from speedkit_examples.vlm import VLM

    device = torch.device(args.accelerator)
    config = vlm_config("small", 64, 40)
    torch.manual_seed(0)
    plain = VLM(config).to(device)
    wrapped = VLM(config).to(device)
    wrapped.load_state_dict(plain.state_dict())
    names = checkpoint_blocks(wrapped)
    batch = 32
    images = torch.randn(batch, 3, config.image_size, config.image_size, device=device)
    ids = torch.randint(4, config.vocab_size, (batch, config.max_text_len), device=device)
    saved = {
        "plain": saved_bytes(plain, images, ids),
        "checkpointed": saved_bytes(wrapped, images, ids),
    }
    times: dict[str, list[float]] = {"plain": [], "checkpointed": []}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4)
                  for name, m in (("plain", plain), ("checkpointed", wrapped))}  # fmt: skip
    for i in range(2 * args.repeats + 2):  # interleaved; the first of each is warm-up
        name, model = (("plain", plain), ("checkpointed", wrapped))[i % 2]
        if device.type == "cuda":
            torch.cuda.synchronize()  # SYNC: benchmark timing
        start = time.perf_counter()
        logits = model(images, ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()  # SYNC: benchmark timing
        if i >= 2:
            times[name].append(time.perf_counter() - start)
    step = {name: statistics.median(t) for name, t in times.items()}
    return {
        "preset": "small", "batch": batch, "blocks": len(names),
        "saved_bytes": saved,
        "planned_bytes": {"plain": vlm_activations(config, batch, 4, False),
                          "checkpointed": vlm_activations(config, batch, 4, True)},
        "step_s": step, "step_ratio": step["checkpointed"] / step["plain"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--devices", type=int, default=2, help="processes (one per GPU on CUDA)")
    parser.add_argument("--size", default="base")
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--text-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--static-graph", action="store_true",
                        help="static_graph=True for the kit's DDP (ddp_powersgd)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="part 2: timed steps per variant")
    parser.add_argument("--work", default="/tmp/speedkit_memory_bench")
    parser.add_argument("--out", default=str(HERE.parent / "results" / "memory_cpu.json"))
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return None
    print(f"part 1: {args.size} VLM, {args.devices} process(es), {args.accelerator}")
    rows = part1(args)
    rss = "   process GiB" if args.accelerator == "cpu" else ""
    print(f"\nstrategy          ckpt   measured GiB   planned GiB   ratio   peak in{rss}   step s")
    for r in rows:
        resident = f"{r['rss_bytes'] / GIB:>14.2f}" if "rss_bytes" in r else ""
        print(f"{r['strategy']:<16} {'yes' if r['checkpointing'] else 'no':<5} "
              f"{r['measured_bytes'] / GIB:>12.2f} {r['planned_bytes'] / GIB:>13.2f} "
              f"{r['ratio']:>7.2f}   {r['planned_phase'].split('/')[0]:<7}{resident} "
              f"{r['step_s']:>8.2f}")  # fmt: skip
    print("\npart 2: activations and step time, small VLM, batch 32, one process")
    act = part2(args)
    for name in ("plain", "checkpointed"):
        print(f"  {name:<13} saved {act['saved_bytes'][name] / 2**20:8.1f} MiB "
              f"(Korthikanti {act['planned_bytes'][name] / 2**20:8.1f} MiB), "
              f"step {act['step_s'][name] * 1e3:7.1f} ms")  # fmt: skip
    less = act["saved_bytes"]["plain"] / act["saved_bytes"]["checkpointed"]
    print(f"  checkpointing: {less:.1f}x less saved, step time x{act['step_ratio']:.2f}")
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": (
            torch.cuda.get_device_name()
            if args.accelerator == "cuda"
            else platform.processor() or platform.machine()
        ),
        "devices": args.devices,
        "torch": torch.__version__,
        "command": "python benchmarks/memory.py " + " ".join(sys.argv[1:]),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "strategies": rows, "activations": act}
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
