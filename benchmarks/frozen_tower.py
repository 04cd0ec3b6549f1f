"""A frozen vision tower, end to end: training plain and with FrozenFeatureCache.

Each side is a ``Trainer.fit`` of the same model from the same seed on the same samples
(the first ``--samples`` of the example corpus), through the same loader: JPEGs read and
decoded in the training process (``num_workers=0``), shuffled per epoch. The sides
differ only in the callback. With the cache, epoch 0 runs the tower and stores its
features, epoch 1 checks them on its first reuse and serves them, and from then on the
loader builds a served sample without its image: the JPEG is neither read nor decoded,
and the tower does not run. Epochs from ``--warmup`` on are timed (the host clock
around each epoch), sides run in interleaved rounds, and the table shows medians.

``s`` is the share of the plain run's timed epochs that the cache can remove: the
tower's forward (timed by hooks around it) plus the image decoding (the loader's
sample building, timed around each sample, less what building the same samples
without their images costs, measured in the cached run). ``1 / (1 - s)`` is the most
the cache can give; the table prints both shares, the speed-up measured, what share of
the ideal gain it reached, and the store's size in memory. Beside them, per batch: the
tower's forward, and the same call served whole by the cache (its own bookkeeping).

Models: the example VLM (``vlm-tiny``: the demo's model; ``vlm-wide-tower``: the same
decoder behind a wider, deeper tower, as in locked-image tuning; ``vlm-small``;
``vlm-base``, the GPU benchmarks' size) and a Hugging Face
``LlavaForConditionalGeneration`` built from a tiny config (CLIP vision tower and a
Llama decoder; nothing downloaded), fed the same corpus.

    python benchmarks/frozen_tower.py --model vlm-tiny vlm-wide-tower llava-tiny

On a GPU (``--accelerator gpu``, with ``--precision bf16-mixed`` as the GPU benchmarks
train) the epochs are timed between two ``torch.cuda.synchronize()`` calls, the tower's
forward by a pair of CUDA events per call (recorded without waiting, read after the
epoch's synchronize), and the losses are read to the host after each epoch's timing: no
step waits for the device, so the loader's decoding of the next batch overlaps the
device's step as in a plain run. There ``s`` is an upper bound (the decoding may have
been hidden behind the device already), and the share of the ideal gain a lower one.
On CPU the timing is as it was before these options.

    python benchmarks/frozen_tower.py --model vlm-base --accelerator gpu \
        --precision bf16-mixed --samples 512 --epochs 4 --rounds 2

Prints a table and writes JSON (``--out``), after every fit with ``"complete": false``
and the rates so far (a run cut off by a time limit keeps them), then whole.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
import warnings
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.utils.data import DataLoader, Dataset

from lightning_speedkit import FrozenFeatureCache, cache_frozen_features
from speedkit_examples.vlm import CaptionTokenizer, VLMConfig, VLMDataModule, VLMTask
from speedkit_examples.vlm.data import CaptionCollate, EpochShuffle

HERE = Path(__file__).resolve()
MODELS = ("vlm-tiny", "vlm-wide-tower", "vlm-small", "vlm-base", "llava-tiny")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_COUNTS = ("hits", "misses", "inputs_skipped", "store_bytes", "disk_bytes")
"""The cache's counts a row keeps (the store: ``store_bytes`` in host memory,
``disk_bytes`` on disk, 0 here: the benchmark's cache has no ``directory``)."""
_WIDE_TOWER = dict(vision_dim=128, vision_depth=6, vision_heads=4)
_LLAVA_PATCHES = 16  # a 32 x 32 image in 8 x 8 patches


class _Clock:
    """Seconds spent in a span, summed over the timed epochs only."""

    def __init__(self) -> None:
        self.on = False
        self.seconds = 0.0
        self.count = 0

    def add(self, seconds: float, count: int = 1) -> None:
        if self.on:
            self.seconds += seconds
            self.count += count


class _Timed(Dataset[Any]):
    """The first ``n`` samples of ``dataset``, each build timed: in full (``full``) and
    without some fields (``without``: what FrozenFeatureCache asks for once it serves a
    sample)."""

    def __init__(self, dataset: Any, n: int, wrap: Any = None) -> None:
        self.dataset, self.n, self.wrap = dataset, min(n, len(dataset)), wrap or (lambda s: s)
        self.full, self.without = _Clock(), _Clock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        began = time.perf_counter()
        sample = self.wrap(self.dataset[index])
        self.full.add(time.perf_counter() - began)
        return sample

    def speedkit_getitem(self, index: int, without: frozenset[str]) -> Any:
        if not without:
            return self[index]
        began = time.perf_counter()  # the image field, whatever the task calls it: zeros
        sample = self.wrap(self.dataset.speedkit_getitem(index, frozenset({"images"})))
        self.without.add(time.perf_counter() - began)
        return sample


class _Model(NamedTuple):
    """One benchmarked model: how to build its task, its samples and its batches."""

    name: str
    task: Any  # () -> LightningModule with a ``tower`` attribute path
    tower: str
    wrap: Any  # sample -> sample as the task reads it
    collate: Any


def _vlm(name: str, tokenizer: CaptionTokenizer) -> tuple[_Model, VLMConfig]:
    preset = {"vlm-small": "small", "vlm-base": "base"}.get(name, "tiny")
    overrides = _WIDE_TOWER if name == "vlm-wide-tower" else {}
    config = VLMConfig.preset(preset, tokenizer.vocab_size, freeze_vision=True, **overrides)  # type: ignore[arg-type]
    collate = CaptionCollate(tokenizer.pad_id)

    def task() -> L.LightningModule:
        return _VLMTask(config, pad_id=tokenizer.pad_id)

    return _Model(name, task, "model.vision", lambda s: s, collate), config


class _VLMTask(VLMTask):
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        batch.pop("num_skipped", None)
        return batch


def _llava(tokenizer: CaptionTokenizer) -> tuple[_Model, VLMConfig]:
    import transformers

    image_token, pad = tokenizer.vocab_size, tokenizer.pad_id
    config = VLMConfig.preset("tiny", tokenizer.vocab_size)  # 32 x 32 images

    def build() -> L.LightningModule:
        vision = transformers.CLIPVisionConfig(
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        )
        text = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=image_token + 1,
            max_position_embeddings=128,
            pad_token_id=pad,
        )
        llava = transformers.LlavaForConditionalGeneration(
            transformers.LlavaConfig(
                vision_config=vision,
                text_config=text,
                image_token_index=image_token,
                vision_feature_layer=-1,
                vision_feature_select_strategy="default",
            )
        )
        llava.model.vision_tower.requires_grad_(False)
        return _LlavaTask(llava, image_token, pad)

    def wrap(sample: Any) -> Any:
        if sample is None:
            return None
        ids = torch.cat([torch.full((_LLAVA_PATCHES,), image_token), sample["input_ids"]])
        return {"pixel_values": sample["images"], "input_ids": ids}

    def collate(samples: list[Any]) -> dict[str, torch.Tensor]:
        samples = [s for s in samples if s is not None]
        ids = torch.nn.utils.rnn.pad_sequence(
            [s["input_ids"] for s in samples], batch_first=True, padding_value=pad
        )
        return {
            "pixel_values": torch.stack([s["pixel_values"] for s in samples]),
            "input_ids": ids,
            "attention_mask": (ids != pad).long(),
        }

    return _Model("llava-tiny", build, "llava.model.vision_tower", wrap, collate), config


class _LlavaTask(L.LightningModule):
    def __init__(self, llava: Any, image_token: int, pad: int) -> None:
        super().__init__()
        self.llava, self.image_token, self.pad = llava, image_token, pad

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        labels = ids.masked_fill((ids == self.image_token) | (ids == self.pad), -100)
        loss: torch.Tensor = self.llava(**batch, labels=labels).loss
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class _Epochs(L.Callback):
    """Times epochs from ``warmup`` on, and the tower's forward in them; keeps the losses.

    On CUDA the epoch's span runs from one ``synchronize`` to the next, and the tower's
    forward is a pair of CUDA events per call, read after the epoch's ``synchronize``;
    the losses stay on the device until then. No step waits for the device."""

    def __init__(self, warmup: int, tower: str, clocks: list[_Clock], cuda: bool) -> None:
        self.warmup, self.tower_path, self.clocks, self.cuda = warmup, tower, clocks, cuda
        self.epoch, self.tower, self.losses = _Clock(), _Clock(), []  # type: ignore[var-annotated]
        self._began = 0.0
        self._tower_began = 0.0
        self._opened: torch.cuda.Event | None = None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._pending: list[torch.Tensor] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tower = pl_module.get_submodule(self.tower_path)
        if self.cuda:
            tower.register_forward_pre_hook(lambda *_: self._record_start())
            tower.register_forward_hook(lambda *_: self._record_end())
            return
        tower.register_forward_pre_hook(
            lambda *_: setattr(self, "_tower_began", time.perf_counter())
        )
        tower.register_forward_hook(
            lambda *_: self.tower.add(time.perf_counter() - self._tower_began)
        )

    def _record_start(self) -> None:
        self._opened = torch.cuda.Event(enable_timing=True)
        self._opened.record()

    def _record_end(self) -> None:
        if self._opened is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._opened, end))
            self._opened = None

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        timed = trainer.current_epoch >= self.warmup
        for clock in (self.epoch, self.tower, *self.clocks):
            clock.on = timed
        if self.cuda:
            torch.cuda.synchronize()  # SYNC: the epoch's span starts with an idle device
        self._began = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, *args: Any
    ) -> None:
        self._pending.append(outputs["loss"].detach())

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the epoch's last batch was built before its step; the loop's fetch of the next
        # (none) is inside the epoch, so the span covers every build and step of the epoch
        if self.cuda:
            torch.cuda.synchronize()  # SYNC: the span ends when the device's work has
        self.epoch.add(time.perf_counter() - self._began)
        for start, end in self._events:  # ms; every event has completed by now
            self.tower.add(start.elapsed_time(end) / 1e3)
        self._events.clear()
        # SYNC (CUDA): the epoch's losses to the host, once, after its span
        self.losses.extend(float(loss) for loss in self._pending)
        self._pending.clear()


def _fit(model: _Model, dataset: Any, args: argparse.Namespace, cached: bool) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    timed = _Timed(dataset, args.samples, model.wrap)
    loader = DataLoader(
        timed,
        batch_size=args.batch_size,
        sampler=EpochShuffle(timed, seed=0),
        drop_last=True,
        collate_fn=model.collate,
        num_workers=0,
    )
    epochs = _Epochs(args.warmup, model.tower, [timed.full, timed.without], _cuda(args))
    cache = FrozenFeatureCache(modules=[model.tower]) if cached else None
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[epochs, *([cache] if cache else [])],
    )
    trainer.fit(model.task(), loader)
    counts = cache.counts if cache is not None else {}
    return {
        "seconds": epochs.epoch.seconds,
        "tower_seconds": epochs.tower.seconds,
        "full_builds": (timed.full.seconds, timed.full.count),
        "bare_builds": (timed.without.seconds, timed.without.count),
        "losses": epochs.losses,
        **{k: counts.get(k, 0) for k in _COUNTS},
    }


def _cuda(args: argparse.Namespace) -> bool:
    return bool(args.accelerator != "cpu")


def bookkeeping(model: _Model, dataset: Any, args: argparse.Namespace) -> dict[str, float]:
    """Microseconds per batch, medians of ``args.calls`` calls: the tower's own forward on a
    batch of the corpus, and the same call served whole by the cache (the keys looked up,
    the weights' stamp checked, the stored rows stacked). The call is the one the task
    makes, caught by a hook on a forward of the task."""
    device = torch.device("cuda" if _cuda(args) else "cpu")
    task = model.task().to(device)
    tower = task.get_submodule(model.tower)
    batch = model.collate([model.wrap(dataset[i]) for i in range(args.batch_size)])
    batch = move_data_to_device(batch, device)
    dtype = _AUTOCAST.get(args.precision)  # as the Trainer's precision runs the step
    autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()
    call: dict[str, Any] = {}
    hook = tower.register_forward_pre_hook(
        lambda _, a, k: call.update(args=a, kwargs=k), with_kwargs=True
    )
    with torch.no_grad(), warnings.catch_warnings(), autocast:
        warnings.simplefilter("ignore")  # self.log without a Trainer
        task.training_step(batch, 0)
    hook.remove()
    cache = cache_frozen_features(task, modules=[model.tower], verify=False)
    keys = list(range(args.batch_size))

    def forward() -> None:
        tower(*call["args"], **call["kwargs"])

    def served() -> None:
        with cache.keys(keys):
            forward()

    sync = torch.cuda.synchronize if device.type == "cuda" else None
    with torch.no_grad(), autocast:
        served()  # stores the batch: every later call is served whole
        served_us = _median_us(served, args.calls, sync)
        assert cache.counts()["hits"] == args.batch_size * args.calls
        cache.remove()
        forward_us = _median_us(forward, args.calls, sync)
    return {"tower_forward_us": forward_us, "served_call_us": served_us}


def _median_us(fn: Any, calls: int, sync: Any = None) -> float:
    """Median microseconds of ``fn``; with ``sync`` (CUDA) each call from an idle device
    until the device has finished it."""
    times = []
    for _ in range(calls):
        if sync is not None:
            sync()  # SYNC: the call starts with nothing queued
        began = time.perf_counter()
        fn()
        if sync is not None:
            sync()  # SYNC: and ends when the device has run it
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e6


def measure(name: str, args: argparse.Namespace, progress: Any = None) -> dict[str, Any]:
    """One model's row; ``progress(side, round, samples_per_sec)`` after every fit."""
    tokenizer = CaptionTokenizer()
    model, config = _llava(tokenizer) if name == "llava-tiny" else _vlm(name, tokenizer)
    dm = VLMDataModule.for_model(config, args.data_dir, batch_size=args.batch_size, progress=False)
    dm.prepare_data()
    dm.setup("fit")
    dataset = dm.datasets["train"]
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "cached": []}
    for r in range(args.rounds):
        for side in ("plain", "cached") if r % 2 == 0 else ("cached", "plain"):
            runs[side].append(_fit(model, dataset, args, cached=side == "cached"))
            if progress is not None:
                progress(side, r, _samples_per_sec(runs[side][-1], args))
    shares = [
        _shares(plain, cached) for plain, cached in zip(runs["plain"], runs["cached"], strict=True)
    ]
    tower = statistics.median(t for t, _ in shares)
    decode = statistics.median(d for _, d in shares)
    plain_sps = statistics.median(_samples_per_sec(run, args) for run in runs["plain"])
    cached_sps = statistics.median(_samples_per_sec(run, args) for run in runs["cached"])
    ideal, speedup = 1 / (1 - tower - decode), cached_sps / plain_sps
    last = runs["cached"][-1]
    calls = bookkeeping(model, dataset, args)
    return {
        "model": name,
        "samples": min(args.samples, len(dataset)),
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "timed_epochs": args.epochs - args.warmup,
        "rounds": args.rounds,
        "plain_samples_per_sec": plain_sps,
        "cached_samples_per_sec": cached_sps,
        "tower_share": tower,
        "decode_share": decode,
        "ideal_speedup": ideal,
        "speedup": speedup,
        "share_of_ideal": (speedup - 1) / (ideal - 1) if ideal > 1 else None,
        "same_losses": all(
            p["losses"] == c["losses"] for p, c in zip(runs["plain"], runs["cached"], strict=True)
        ),
        "loss_gap": max(
            abs(a - b)
            for p, c in zip(runs["plain"], runs["cached"], strict=True)
            for a, b in zip(p["losses"], c["losses"], strict=True)
        ),
        **{k: last[k] for k in _COUNTS},
        **calls,
    }


def _samples_per_sec(run: dict[str, Any], args: argparse.Namespace) -> float:
    steps = (args.samples // args.batch_size) * (args.epochs - args.warmup)
    return float(steps * args.batch_size / run["seconds"])


def _shares(plain: dict[str, Any], cached: dict[str, Any]) -> tuple[float, float]:
    """(tower, decode) shares of a plain run's timed time; decoding is the full builds'
    time less what the same number of builds without images took in the cached run."""
    full_seconds, full_count = plain["full_builds"]
    bare_seconds, bare_count = cached["bare_builds"]
    bare_each = bare_seconds / bare_count if bare_count else 0.0
    decode = max(0.0, full_seconds - full_count * bare_each)
    return plain["tower_seconds"] / plain["seconds"], decode / plain["seconds"]


def _table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'model':<15} {'plain/s':>8} {'cached/s':>9} {'tower':>6} {'decode':>7} {'ideal':>6} "
        f"{'speed-up':>9} {'of ideal':>9} {'store MiB':>10} {'same loss':>9} "
        f"{'tower µs':>9} {'served µs':>10}"
    )
    for row in rows:
        of_ideal = "-" if row["share_of_ideal"] is None else f"{row['share_of_ideal']:.0%}"
        print(
            f"{row['model']:<15} {row['plain_samples_per_sec']:>8.1f} "
            f"{row['cached_samples_per_sec']:>9.1f} {row['tower_share']:>6.1%} "
            f"{row['decode_share']:>7.1%} {row['ideal_speedup']:>6.2f} {row['speedup']:>9.2f} "
            f"{of_ideal:>9} {row['store_bytes'] / 2**20:>10.2f} {row['same_losses']!s:>9} "
            f"{row['tower_forward_us']:>9.0f} {row['served_call_us']:>10.0f}"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["vlm-tiny"], choices=MODELS)
    parser.add_argument("--samples", type=int, default=1024, help="the corpus's first N samples")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2, help="epochs not timed (at least 2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--calls", type=int, default=200, help="calls timed for the per-batch bookkeeping"
    )
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu", "cuda"))
    parser.add_argument("--precision", default="32-true", choices=PRECISIONS)
    parser.add_argument("--out", type=Path, default=HERE.parent / "results" / "frozen_tower.json")
    args = parser.parse_args(argv)
    if args.warmup < 2 or args.epochs <= args.warmup or args.rounds < 1:
        parser.error("need --warmup >= 2 (fill, verify), --epochs > --warmup, --rounds >= 1")
    if args.samples < args.batch_size:
        parser.error("--samples must be at least --batch-size")
    if _cuda(args) and not torch.cuda.is_available():
        parser.error(f"--accelerator {args.accelerator} needs a CUDA device; torch sees none")
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # one table, not 2N banners
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {args.threads} thread(s), torch {torch.__version__}",
        "device": torch.cuda.get_device_name(0) if _cuda(args) else "cpu",
        "torch": torch.__version__,
        "precision": args.precision,
        "complete": False,
        "progress": [],
        "rows": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.model:

        def progress(side: str, round_: int, rate: float, name: str = name) -> None:
            report["progress"].append(
                {"model": name, "round": round_, "side": side, "samples_per_sec": rate}
            )
            args.out.write_text(json.dumps(report, indent=2) + "\n")  # what a time limit keeps

        report["rows"].append(measure(name, args, progress))
        args.out.write_text(json.dumps(report, indent=2) + "\n")  # after each model
    report["complete"] = True
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['device']}, {report['precision']}, torch {report['torch']}")
    _table(report["rows"])
    return report


if __name__ == "__main__":
    main()
