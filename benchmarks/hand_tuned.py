"""The kit against what an expert writes by hand for the same model: plain, kit, hand-tuned.

``speedkit demo`` compares plain Lightning with the kit. A speed-up over plain says how
much the kit finds; it does not say how much it leaves. This benchmark adds a third
run: the example VLM as an engineer who knows the levers would tune it by hand, with
no part of the kit (SpeedMonitor, the yardstick, aside):

- SDPA written into the model: each attention module's forward calls
  ``F.scaled_dot_product_attention`` (``is_causal=True`` in the decoder) instead of its
  explicit softmax; same parameters, same initialisation;
- AdamW constructed with ``fused=True`` (the task's own groups, learning rate and warm-up);
- ``torch.compile`` of the whole model (on by default where the model runs on CUDA;
  ``--compile`` to force it on CPU, where the kit measured compiled blocks slower);
- the loader: the training split decoded into memory once before training (``--preload``,
  the default; the corpus is 49 MiB at 32 px and 2.3 GiB at 224 px), ``--num-workers``
  processes, pinned memory on CUDA;
- the micro-batch (``--micro-batch``; the optimizer's batch stays ``--batch-size``, with
  gradient accumulation when the micro-batch is smaller).

The three runs train the same model from the same seed on the same data order and
precision, each for ``--steps`` optimizer steps, one after another in one process
(``--rounds`` repeats the three); every figure is SpeedMonitor's, measured alike.

    python benchmarks/hand_tuned.py                                    # CPU: tiny VLM, fp32
    python benchmarks/hand_tuned.py --size base --precision bf16-mixed # a GPU: VLM base

Prints a table and writes JSON (``--out``), after each run as well as at the end: a run
that crashes or runs out of time loses only itself (``"complete": false`` until the end).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit._demo import (
    DemoConfig,
    DemoResult,
    _quiet_third_party,
    _train,
    comparison_table,
    fit_and_measure,
    runs_on_cuda,
    shared_peak,
)
from lightning_speedkit.measure.speed_monitor import PeakSetting
from speedkit_examples.vlm.data import Batch, VLMDataModule
from speedkit_examples.vlm.model import CausalSelfAttention, VisionSelfAttention, VLMConfig
from speedkit_examples.vlm.task import VLMTask
from speedkit_examples.vlm.tokenizer import CaptionTokenizer

HERE = Path(__file__).resolve()


# ---------------------------------------------------------------- the model, by hand


class SDPAVisionSelfAttention(VisionSelfAttention):
    """The vision attention with its softmax written as one SDPA call."""

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(out.transpose(1, 2).reshape(B, N, C))


class SDPACausalSelfAttention(CausalSelfAttention):
    """The decoder attention with its masked softmax written as one causal SDPA call."""

    def forward(self, x: Tensor) -> Tensor:
        B, S, C = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, C))


_SDPA: dict[type[nn.Module], type[nn.Module]] = {
    VisionSelfAttention: SDPAVisionSelfAttention,
    CausalSelfAttention: SDPACausalSelfAttention,
}


def write_sdpa_into(model: nn.Module) -> int:
    """Give each of the example's attention modules its SDPA forward; how many."""
    changed = 0
    for module in model.modules():
        hand = _SDPA.get(type(module))
        if hand is not None:
            module.__class__ = hand
            changed += 1
    return changed


class HandTunedTask(VLMTask):
    """The example task with fused AdamW and, optionally, the whole model compiled."""

    def __init__(self, config: VLMConfig, pad_id: int, compile_model: bool) -> None:
        super().__init__(config, pad_id=pad_id)
        self.attention_modules = write_sdpa_into(self.model)
        self.compile_model = compile_model
        # Not a submodule: the state_dict keeps the model's keys only, once.
        self._forward: Callable[[Tensor, Tensor], Tensor]
        object.__setattr__(self, "_forward", self.model)

    def configure_model(self) -> None:
        if self.compile_model and self._forward is self.model:
            # Beside ``model``, not in its place: checkpoint keys stay the model's. The
            # caption length varies by batch: dynamo recompiles once, marking it dynamic.
            object.__setattr__(self, "_forward", torch.compile(self.model))

    def forward(self, images: Tensor, input_ids: Tensor) -> Tensor:
        logits: Tensor = self._forward(images, input_ids)
        return logits

    def configure_optimizers(self) -> Any:
        """The task's AdamW and warm-up, the AdamW constructed with ``fused=True``."""
        config = super().configure_optimizers()
        own, schedule = config["optimizer"], config["lr_scheduler"]["scheduler"]
        optimizer = torch.optim.AdamW(
            [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in own.param_groups],
            lr=own.defaults["lr"],
            betas=own.defaults["betas"],
            eps=own.defaults["eps"],
            fused=True,
        )
        config["optimizer"] = optimizer
        config["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(
            optimizer, schedule.lr_lambdas
        )
        return config


# ---------------------------------------------------------------- the loader, by hand


class InMemory(Dataset[Any]):
    """Every sample of ``dataset``, decoded once, kept in a list."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.samples = [dataset[i] for i in range(len(dataset))]  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Any:
        return self.samples[index]


class HandTunedData(VLMDataModule):
    """The example's loaders, with the training split preloaded and the loader tuned."""

    def __init__(
        self, *args: Any, micro_batch: int, preload: bool, pin_memory: bool, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.micro_batch = micro_batch
        self.preload = preload
        self.pin_memory = pin_memory
        self.preloaded: InMemory | None = None

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.preload and self.preloaded is None and stage == "fit":
            self.preloaded = InMemory(self.datasets["train"])

    def train_dataloader(self) -> DataLoader[Batch]:
        train = self.datasets["train"]
        dataset: Dataset[Any] = train if self.preloaded is None else self.preloaded
        workers = self.num_workers
        return DataLoader(
            dataset,
            batch_size=self.micro_batch,
            sampler=self.shuffle_sampler(train),  # the same order as plain's
            drop_last=True,
            num_workers=workers,
            collate_fn=self.collate,
            pin_memory=self.pin_memory,
            persistent_workers=workers > 0,
            prefetch_factor=4 if workers else None,
        )


def train_hand_tuned(
    config: DemoConfig,
    peak: PeakSetting,
    *,
    micro_batch: int,
    num_workers: int,
    preload: bool,
    compile_model: bool,
) -> DemoResult | None:
    """The hand-tuned run: same seed, data order, precision and optimizer batch as plain's."""
    if config.batch_size % micro_batch:
        raise ValueError(
            f"--micro-batch {micro_batch} does not divide --batch-size {config.batch_size}: "
            "the optimizer's batch must stay the plain run's."
        )
    L.seed_everything(config.seed, workers=True, verbose=False)
    tokenizer = CaptionTokenizer()
    model_cfg = VLMConfig.preset(config.size, tokenizer.vocab_size)  # type: ignore[arg-type]
    datamodule = HandTunedData.for_model(
        model_cfg,
        config.data_dir,
        batch_size=config.batch_size,
        num_workers=num_workers,
        micro_batch=micro_batch,
        preload=preload,
        pin_memory=runs_on_cuda(config.accelerator),
    )
    task = HandTunedTask(model_cfg, pad_id=tokenizer.pad_id, compile_model=compile_model)
    accumulation = config.batch_size // micro_batch
    fitted = fit_and_measure(
        config, "hand", task, datamodule, peak, callbacks=[], accumulate_grad_batches=accumulation
    )
    if fitted is None:
        return None
    result, _ = fitted
    preloaded = datamodule.preloaded
    loading = (
        f"{len(preloaded):,} samples decoded into memory before training"
        if preloaded is not None
        else "samples decoded each epoch"
    )
    result.notes = [
        f"hand: SDPA written into {task.attention_modules} attention modules; AdamW(fused=True); "
        + ("the whole model torch.compile'd" if compile_model else "not compiled")
        + f"; micro-batch {micro_batch} x {accumulation}; {loading}, num_workers={num_workers}"
    ]
    return result


# ---------------------------------------------------------------- the benchmark


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _summary(rounds: list[dict[str, DemoResult]]) -> dict[str, Any]:
    """Per-round ratios of samples/s and their medians (the runs of a round are adjacent)."""
    pairs = {
        "kit/plain": ("kit", "plain"),
        "hand/plain": ("hand", "plain"),
        "kit/hand": ("kit", "hand"),
    }
    out: dict[str, Any] = {}
    for label, (a, b) in pairs.items():
        values = [
            r
            for round_ in rounds
            if a in round_
            and b in round_
            and (r := _ratio(round_[a].samples_per_sec, round_[b].samples_per_sec)) is not None
        ]
        if values:
            out[label] = {"rounds": values, "median": statistics.median(values)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", default="tiny", help="VLM preset: tiny, small, base")
    parser.add_argument(
        "--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed"
    )
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps per run")
    parser.add_argument("--warmup-steps", type=int, default=10, help="steps left out of speeds")
    parser.add_argument("--batch-size", type=int, default=32, help="the optimizer's batch")
    parser.add_argument("--micro-batch", type=int, default=None, help="hand-tuned (default: batch)")
    parser.add_argument("--num-workers", type=int, default=0, help="hand-tuned loader workers")
    parser.add_argument(
        "--preload", action=argparse.BooleanOptionalAction, default=True,
        help="hand-tuned: decode the training split into memory before training",
    )  # fmt: skip
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=None,
        help="hand-tuned: torch.compile the model (default: on CUDA only)",
    )  # fmt: skip
    parser.add_argument("--runs", default="plain,kit,hand", help="which runs, in this order")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the runs this many times")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--output-dir", default="speedkit_runs/hand_tuned")
    parser.add_argument("--out", type=Path, default=None, help="JSON (default: results/)")
    args = parser.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = sorted(set(runs) - {"plain", "kit", "hand"})
    if unknown or not runs:
        parser.error(f"--runs: unknown {unknown}; choose from plain, kit, hand")
    if args.rounds < 1 or args.steps <= args.warmup_steps:
        parser.error("--rounds must be at least 1 and --steps more than --warmup-steps")

    on_cuda = runs_on_cuda(args.accelerator)
    compile_model = on_cuda if args.compile is None else args.compile
    micro_batch = args.micro_batch or args.batch_size
    config = DemoConfig(
        steps=args.steps,
        size=args.size,
        accelerator=args.accelerator,
        precision=args.precision,
        batch_size=args.batch_size,
        data_dir=args.data_dir,
        output_dir=args.output_dir,
        seed=args.seed,
        warmup_steps=args.warmup_steps,
    )
    peak = shared_peak(args.accelerator, args.precision)
    device = torch.cuda.get_device_name() if on_cuda else _cpu_name()
    print(
        f"VLM {args.size}, {args.precision}, batch {args.batch_size}, {args.steps} steps per run, "
        f"{args.rounds} round(s) of {', '.join(runs)}; {device}, torch {torch.__version__}"
    )

    out = args.out or HERE.parent / "results" / f"hand_tuned_{'cuda' if on_cuda else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "benchmark": "hand_tuned",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "command": "python benchmarks/hand_tuned.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {
            **vars(args),
            "out": _shown(out),
            "compile": compile_model,
            "micro_batch": micro_batch,
        },
    }

    rounds: list[dict[str, DemoResult]] = []
    with _quiet_third_party():
        for index in range(args.rounds):
            done: dict[str, DemoResult] = {}
            rounds.append(done)
            for run in runs:
                run_config = replace(config, output_dir=f"{args.output_dir}/round{index}")
                if run == "hand":
                    result = train_hand_tuned(
                        run_config, peak, micro_batch=micro_batch, num_workers=args.num_workers,
                        preload=args.preload, compile_model=compile_model,
                    )  # fmt: skip
                else:
                    result = _train(run_config, run, peak)
                if result is None:  # not rank 0
                    return 0
                done[run] = result
                # Each run's figures reach the file as it ends: a crash or a time limit
                # in a later run (a GPU machine's) loses only that run.
                _write(out, header, rounds, complete=False)
            print(f"\nround {index + 1} of {args.rounds}")
            print(comparison_table(list(done.values())))

    summary = _summary(rounds)
    print("\nsamples/s ratios, per round (median):")
    for label, values in summary.items():
        shown = ", ".join(f"{v:.2f}x" for v in values["rounds"])
        print(f"  {label:<10} {shown}  ({values['median']:.2f}x)")
    wall = _wall(rounds)
    print("wall time of fit, compilation included (s, median): " + ", ".join(
        f"{run} {seconds:.1f}" for run, seconds in wall.items()
    ))  # fmt: skip
    _write(out, header, rounds, complete=True)
    print(f"wrote {out}")
    return 0


def _wall(rounds: list[dict[str, DemoResult]]) -> dict[str, float]:
    """Each run's median wall time of fit over the rounds it ran in (compilation included)."""
    runs = dict.fromkeys(run for round_ in rounds for run in round_)
    return {run: statistics.median(r[run].wall_sec for r in rounds if run in r) for run in runs}


def _write(
    out: Path, header: dict[str, Any], rounds: list[dict[str, DemoResult]], *, complete: bool
) -> None:
    """The record of the runs done so far; ``complete`` once every round has run."""
    record = {
        **header,
        "complete": complete,
        "rounds": [{run: asdict(r) for run, r in round_.items()} for round_ in rounds],
        "ratios": _summary(rounds),
        "wall_sec_median": _wall(rounds),
    }
    text = json.dumps(_finite(record), indent=2, default=str, allow_nan=False)
    partial = out.with_name(out.name + ".tmp")
    partial.write_text(text)
    partial.replace(out)  # a reader never sees half a file


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None: JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _shown(path: Path) -> str:
    """``path`` as the record shows it: relative to the repository where it is inside."""
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(HERE.parents[1]))
    return str(path)


def _cpu_name() -> str:
    """The CPU's model name and core count (``platform.processor()`` is often empty)."""
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main())
