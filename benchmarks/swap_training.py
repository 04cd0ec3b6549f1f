"""Does a swapped attention train like the model's own? Gradient error and loss, per backend.

A parity check compares one forward (and backward) of each swapped module; training
compounds whatever it lets through. This benchmark trains the example VLM from one
initialisation on the same fixed batches, once with the model's own attention and once
per attention backend, and reports for each:

- the relative error of the first step's gradient (all parameters, one vector) against
  the same model's gradient in float32 without autocast: the yardstick is the plain
  model's own error in the same precision, so a kernel is suspect only where its error
  is well above that;
- the training loss over the last steps and the held-out loss after ``--steps`` AdamW
  steps (the task's own optimizer and warm-up).

``math`` (PyTorch's reference attention, no fused kernel) is the control: it differs
from the model's attention only by rounding, so its loss gap is what rounding alone
does to this run.

    python benchmarks/swap_training.py --accelerator cuda     # bf16 autocast, VLM base
    python benchmarks/swap_training.py                        # CPU, tiny VLM, fp32

Prints a table and writes JSON (``--out``), after each variant as well as at the end
(``"complete": false`` until the last): a time limit loses only the variants it cuts off.
Each swapped variant's row lists every attention module's parity check (status, kernel,
error against float32), the decoder's included.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from lightning_speedkit.attention import BACKENDS, swap_attention
from speedkit_examples.vlm.data import VLMDataModule
from speedkit_examples.vlm.model import VLMConfig
from speedkit_examples.vlm.task import VLMTask
from speedkit_examples.vlm.tokenizer import CaptionTokenizer

HERE = Path(__file__).resolve()


def _batches(
    dm: VLMDataModule, split: str, n: int, device: torch.device
) -> list[dict[str, Tensor]]:
    loader = dm.train_dataloader() if split == "train" else dm.val_dataloader()
    out = []
    for batch in loader:
        batch.pop("num_skipped", None)
        out.append({k: v.to(device) for k, v in batch.items()})
        if len(out) == n:
            break
    return out


def _autocast(
    device: torch.device, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager[Any]:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _loss(task: VLMTask, batch: dict[str, Tensor]) -> Tensor:
    logits, targets = task._logits_and_targets(batch)
    return task._loss(logits.float(), targets)


def _flat_grad(task: VLMTask) -> Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double()
            for p in task.parameters()
        ]
    )


def _first_grad(
    task: VLMTask, batch: dict[str, Tensor], device: torch.device, dtype: torch.dtype | None
) -> Tensor:
    task.zero_grad(set_to_none=True)
    with _autocast(device, dtype):
        _loss(task, batch).backward()
    grad = _flat_grad(task)
    task.zero_grad(set_to_none=True)
    return grad


def _train(
    task: VLMTask,
    train: list[dict[str, Tensor]],
    val: list[dict[str, Tensor]],
    steps: int,
    device: torch.device,
    dtype: torch.dtype | None,
) -> dict[str, Any]:
    config = task.configure_optimizers()
    optimizer, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
    losses: list[Tensor] = []
    start = time.perf_counter()
    for step in range(steps):
        with _autocast(device, dtype):
            loss = _loss(task, train[step % len(train)])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(loss.detach())
    curve = torch.stack(losses).cpu().tolist()  # one read at the end
    seconds = time.perf_counter() - start
    task.eval()
    with torch.no_grad(), _autocast(device, dtype):
        held_out = sum(_loss(task, b).item() for b in val) / len(val)
    task.train()
    tail = max(1, min(5, steps // 10))
    return {
        "loss_curve": curve,
        "train_loss_end": sum(curve[-tail:]) / tail,
        "held_out_loss": held_out,
        "nonfinite_steps": sum(1 for x in curve if x != x or abs(x) == float("inf")),
        "seconds": seconds,
    }


@contextlib.contextmanager
def _cudnn_sdp(enabled: bool) -> Iterator[None]:
    if not torch.cuda.is_available():
        yield
        return
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(enabled)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def _write(
    out: Path, header: dict[str, Any], rows: list[dict[str, Any]], *, complete: bool
) -> None:
    """The record of the variants done so far; ``complete`` once every variant has run."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".tmp")
    partial.write_text(json.dumps({**header, "complete": complete, "rows": rows}, indent=2))
    partial.replace(out)  # a reader never sees half a file


def _fmt(value: float | None, spec: str, width: int) -> str:
    return format(value, spec) if value is not None else "-".rjust(width)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--size", default=None, help="VLM preset (default: base on CUDA, tiny on CPU)"
    )
    parser.add_argument(
        "--precision",
        choices=("bf16", "fp16", "fp32"),
        default=None,
        help="autocast dtype (default: bf16 on CUDA, fp32 on CPU)",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=6, help="fixed training batches, cycled")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--val-batches", type=int, default=4)
    parser.add_argument(
        "--backends",
        nargs="+",
        default=None,
        help="swap variants (default: math, sdpa and every backend the device runs, "
        "auto, and auto with cuDNN attention off on CUDA)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    device = torch.device(args.accelerator)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--accelerator cuda: no CUDA device")
    size = args.size or ("base" if device.type == "cuda" else "tiny")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]
    if args.backends is None:
        fused = ("flash", "efficient", "cudnn") if device.type == "cuda" else ()
        args.backends = ["math", "sdpa", *fused, "auto"]
        if device.type == "cuda":
            args.backends.append("auto-no-cudnn")
    for name in args.backends:
        if name.removesuffix("-no-cudnn") not in ("auto", *BACKENDS):
            parser.error(f"--backends: unknown {name!r}; choose from auto, {', '.join(BACKENDS)}")
    out = args.out or HERE.parent / "results" / f"swap_training_{device.type}.json"

    L.seed_everything(args.seed, verbose=False)
    tokenizer = CaptionTokenizer()
    cfg = VLMConfig.preset(size, tokenizer.vocab_size)  # type: ignore[arg-type]
    dm = VLMDataModule.for_model(cfg, args.data_dir, batch_size=args.batch_size, progress=False)
    dm.prepare_data()
    dm.setup("fit")
    train = _batches(dm, "train", args.batches, device)
    val = _batches(dm, "val", args.val_batches, device)
    initial = VLMTask(cfg, pad_id=tokenizer.pad_id).to(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(
        f"VLM {size}, {precision}, batch {args.batch_size}, {args.batches} fixed batches, "
        f"{args.steps} AdamW steps, {device.type} ({name or platform.machine()})"
    )

    header = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": name,
        "torch": torch.__version__,
        "size": size,
        "precision": precision,
        "batch_size": args.batch_size,
        "batches": args.batches,
        "steps": args.steps,
        "seed": args.seed,
    }
    reference = _first_grad(copy.deepcopy(initial), train[0], device, None)  # fp32, no autocast
    rows: list[dict[str, Any]] = []
    for variant in ["own", *args.backends]:
        task = copy.deepcopy(initial)
        backend = variant.removesuffix("-no-cudnn")
        with _cudnn_sdp(not variant.endswith("-no-cudnn")):
            picked: dict[str, int] = {}
            reverted = 0
            parity: list[dict[str, Any]] = []
            if variant != "own":
                with _autocast(device, dtype):
                    report = swap_attention(
                        task,
                        backend,
                        sample=(
                            train[0]["images"],  # type: ignore[arg-type]
                            train[0]["input_ids"][:, :-1],
                        ),
                        measure=False,
                    )
                picked = dict(
                    Counter(m.backend or "?" for m in report.modules if m.status != "reverted")
                )
                reverted = len(report.reverted)
                parity = report.as_dict()["modules"]  # each module's check, the decoder's too
            grad = _first_grad(task, train[0], device, dtype)
            grad_error = ((grad - reference).norm() / reference.norm()).item()
            result = _train(task, train, val, args.steps, device, dtype)
        row = {
            "variant": variant,
            "kernels": picked,
            "reverted": reverted,
            "parity": parity,
            "grad_rel_error": grad_error,
            **result,
        }
        rows.append(row)
        _write(out, header, rows, complete=False)  # a time limit loses only the variants after
        kernels = ", ".join(f"{k} x{v}" for k, v in sorted(picked.items())) or "-"
        print(
            f"  {variant:<14} grad error {grad_error:.2e}  train {row['train_loss_end']:.3f}  "
            f"held-out {row['held_out_loss']:.3f}  kernels: {kernels}"
            + (f" ({reverted} reverted)" if reverted else ""),
            flush=True,
        )
        del task
        if device.type == "cuda":
            torch.cuda.empty_cache()

    own = rows[0]
    print(
        f"\n{'variant':<15}{'grad rel. error':>16}{'x own':>7}{'train loss':>12}"
        f"{'held-out':>10}{'vs own':>8}  kernels"
    )
    for row in rows:
        kernels = ", ".join(f"{k} x{v}" for k, v in sorted(row["kernels"].items())) or "-"
        times = row["grad_rel_error"] / own["grad_rel_error"] if own["grad_rel_error"] else None
        print(
            f"{row['variant']:<15}{row['grad_rel_error']:>16.2e}"
            f"{_fmt(times, '>7.1f', 7)}{row['train_loss_end']:>12.3f}"
            f"{row['held_out_loss']:>10.3f}{row['held_out_loss'] - own['held_out_loss']:>+8.3f}"
            f"  {kernels}"
        )
    _write(out, header, rows, complete=True)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
