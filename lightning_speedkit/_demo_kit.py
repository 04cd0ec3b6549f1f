"""The kit side of ``speedkit demo``: its levers, its cached loader, and the notes they leave."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_speedkit import _compat
from lightning_speedkit._demo_results import DemoConfig
from lightning_speedkit.attention import AttentionSwap
from lightning_speedkit.compute import FusedOptimizer, RegionalCompile
from lightning_speedkit.compute.frozen_feature_cache import FrozenFeatureCache
from lightning_speedkit.data import NumWorkersTuner, SampleCache, SpeedDataModuleMixin
from lightning_speedkit.measure import ProfilerSchedule
from lightning_speedkit.schedule import AccumulationScheduler, accumulation_for
from speedkit_examples.vlm import VLMDataModule
from speedkit_examples.vlm.data import Batch


class TowerShare(L.Callback):
    """The share of each training step the vision tower's forward takes, after ``skip``
    batches: what caching a frozen tower's features can remove at most (``1 / (1 - s)``).

    Timed around the tower and around the step: with CUDA events on a GPU, read once when
    training ends, and with the host clock on a CPU (where the work is done when the
    call returns).
    """

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.share: float | None = None
        self._spans: dict[str, list[tuple[Any, Any]]] = {"tower": [], "step": []}
        self._open: dict[str, Any] = {}
        self._batches = 0
        self._cuda = False
        self._handles: list[Any] = []

    def _mark(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # SYNC-free: read once, at the end of training
        return event

    def _start(self, what: str) -> None:
        if self._batches > self.skip:
            self._open[what] = self._mark()

    def _end(self, what: str) -> None:
        began = self._open.pop(what, None)
        if began is not None:
            self._spans[what].append((began, self._mark()))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._cuda = trainer.strategy.root_device.type == "cuda"
        tower = pl_module.get_submodule("model.vision")
        self._handles = [
            tower.register_forward_pre_hook(lambda *_: self._start("tower")),
            tower.register_forward_hook(lambda *_: self._end("tower")),
        ]

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._batches += 1
        self._start("step")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._end("step")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        if self._cuda:
            torch.cuda.synchronize()  # SYNC: once, to read the events

        def seconds(spans: list[tuple[Any, Any]]) -> float:
            if self._cuda:
                return sum(a.elapsed_time(b) for a, b in spans) / 1e3
            return sum(b - a for a, b in spans)

        step = seconds(self._spans["step"])
        self.share = seconds(self._spans["tower"]) / step if step > 0 else None


def frozen_notes(cache: FrozenFeatureCache | None, tower: TowerShare | None) -> list[str]:
    """What the frozen tower cost the plain run, and what the kit's cache did about it."""
    notes = []
    if tower is not None and tower.share is not None:
        notes.append(
            f"plain: the frozen vision tower's forward took {tower.share:.1%} of the step "
            f"(timed around it): a cache of its features gives at most "
            f"1/(1-s) = {1 / (1 - min(tower.share, 0.99)):.2f}x"
        )
    if cache is not None:
        counts = cache.counts
        notes.append(
            f"kit: FrozenFeatureCache: {counts.get('hits', 0):,} samples' tower features "
            f"served from memory ({counts.get('store_bytes', 0) / 2**20:.1f} MiB), "
            f"{counts.get('misses', 0):,} run; the loader was told it need not produce "
            f"{counts.get('inputs_skipped', 0):,} samples' images (not decoded, or served "
            "as SampleCache holds them); MFU counts only the FLOPs that ran"
        )
    return notes


class _CacheAtStart(L.Callback):
    """How many samples the kit's cache held when training began, and how they got there.

    The tuner's trials read through the cache in this process before the warm-up fills
    the rest, so the cache's miss count at the end mixes reads made before the first
    step with reads made during training; this takes the count apart at the first step.
    """

    def __init__(self) -> None:
        self.misses: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        cache = getattr(_compat.datamodule(trainer), "sample_cache", None)
        self.misses = cache.misses if cache is not None else None


def cache_note(cache: SampleCache, misses_at_start: int | None) -> str:
    """The demo's line on the kit's sample cache: what was decoded before the first step
    (by the warm-up's workers, by the tuner's trials in this process) and during training.

    Example::

        >>> cache = SampleCache(list(range(10)))
        >>> cache.warmed, cache.misses, cache.hits, cache.nbytes = 6, 4, 30, 2**20
        >>> note = cache_note(cache, misses_at_start=4)
        >>> for part in note.split("): ")[1].split(", "):
        ...     print(part)
        10 in memory before the first step (6 decoded by the warm-up's workers
        4 by the tuner's trials in this process)
        0 read during training
        30 served from memory (1 MiB)
    """
    before = cache.warmed + (misses_at_start or 0)
    during = cache.misses - (misses_at_start or 0)
    how = f"{cache.warmed:,} decoded by the warm-up's workers"
    if misses_at_start:
        how += f", {misses_at_start:,} by the tuner's trials in this process"
    return (
        f"kit: SampleCache: decoded samples kept in memory (same data, same order): "
        f"{before:,} in memory before the first step ({how}), {during:,} read during "
        f"training, {cache.hits:,} served from memory ({cache.nbytes / 2**20:.0f} MiB)"
    )


class _KitVLMData(SpeedDataModuleMixin, VLMDataModule):
    """The example's DataModule with the kit's loader: tuned workers, decoded samples cached.

    The example decodes a JPEG, resizes it and tokenizes its caption for every sample
    of every epoch; the corpus is small enough (4,096 samples: 49 MiB decoded at 32
    pixels, 2.4 GiB at 224) to keep. Same samples, same order: the loss does not
    change. The cache is kept where loading runs in the training process, and warmed
    before the first step by worker processes (on 2 cores: 0.9 s, against the first
    epoch's decoding one sample after another between steps); loader workers (what the
    tuner picks when it has cores to give) would each hold their own copy, so with
    workers the loader goes uncached. The cache is warmed only once the tuner has chosen
    in-process loading: worker candidates forked from a warm cache would be timed at the
    cache's speed, not at the uncached speed they would run at.
    """

    sample_cache: SampleCache | None = None
    cache_bytes = 4 * 2**30

    def train_dataloader(self) -> DataLoader[Batch]:
        tuned = getattr(self, "speed_loader_kwargs", None) or {}
        in_process = tuned.get("num_workers", self.num_workers) == 0
        dataset = self.datasets["train"]
        loader = self.speed_dataloader(
            dataset, batch_size=self.batch_size, sampler=self.shuffle_sampler(dataset),
            drop_last=True, collate_fn=self.collate,
            cache=self.cache_bytes if in_process else False,
            warm_cache=in_process and bool(tuned),  # not for the tuner's trials: see above
            num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
        )  # fmt: skip
        cached = loader.dataset
        self.sample_cache = cached if isinstance(cached, SampleCache) else None
        return loader


@dataclass
class _Kit:
    """The kit run's callbacks, each a lever that keeps the run's numerics.

    The loader (tuned workers, decoded samples cached), the compute (fused attention,
    a fused optimizer, compiled blocks on CUDA) and one profiled window with its report.
    A lever is in the kit where it was measured to pay at the demo's shapes. Plain
    Lightning runs with none. MicroBatchTuner is left out: the example's loss is a mean
    over each micro-batch's caption tokens, so cutting the global batch otherwise weighs
    tokens otherwise (first-step loss 3.581 against 3.584 at 4 x 8 vs plain's cut): a
    change of numerics, however small.
    """

    tuner: NumWorkersTuner
    profiler: ProfilerSchedule
    compile: RegionalCompile | None
    """None on CPU (see the note it leaves)."""
    fused: FusedOptimizer
    accumulation: AccumulationScheduler | None
    """With a global batch: the same micro-batches per optimizer step as plain's."""
    swap: AttentionSwap
    frozen: FrozenFeatureCache | None = None
    """With ``--freeze-vision``: the tower's features served after the first epoch."""
    cache_at_start: _CacheAtStart = field(default_factory=_CacheAtStart)
    """Not a lever: where the cache's samples came from (the notes)."""

    @classmethod
    def build(cls, config: DemoConfig, on_cuda: bool) -> _Kit:
        # The profiler counts batches: with a global batch, several per optimizer step.
        batches = config.steps * (
            1
            if config.global_batch is None
            else accumulation_for(config.global_batch, config.batch_size, config.devices)
        )
        return cls(
            tuner=NumWorkersTuner(progress=False),
            profiler=ProfilerSchedule(
                skip_first=max(batches - 4, 0),  # the last batches: the figures stay clean
                wait=0,
                warmup=1,
                active=3,
                repeat=1,
                dirpath=Path(config.output_dir) / "kit" / "profiler",
            ),
            compile=RegionalCompile(verbose=False) if on_cuda else None,
            fused=FusedOptimizer(verbose=False),
            accumulation=None
            if config.global_batch is None
            else AccumulationScheduler(
                target_global_batch=config.global_batch,
                micro_batch_size=config.batch_size,
                verbose=False,
            ),
            swap=AttentionSwap(verbose=False),
            frozen=FrozenFeatureCache() if config.freeze_vision else None,
        )

    def callbacks(self) -> list[L.Callback]:
        optional = (self.accumulation, self.compile, self.frozen)
        levers: list[L.Callback] = [lever for lever in optional if lever is not None]
        return [self.swap, *levers, self.fused, self.tuner, self.profiler]

    def notes(self, config: DemoConfig) -> list[str]:
        """What each lever did, one line each."""
        notes = []
        result = self.tuner.result
        if result is not None:
            best = result.best
            notes.append(
                f"kit: NumWorkersTuner chose num_workers={best['num_workers']}"
                + (f", prefetch_factor={best['prefetch_factor']}" if best["num_workers"] else "")
                + (" (the loader as given)" if best["num_workers"] == config.num_workers else "")
            )
        swap = self.swap.report
        swapped = len(swap.swapped) if swap is not None else 0
        reasons = [why for _, why in swap.reverted] if swap is not None else []
        faster = sum(why.startswith("own forward faster") for why in reasons)
        parity = len(reasons) - faster
        notes.append(
            f"kit: AttentionSwap: {swapped} attention modules on a fused kernel"
            + (f", {faster} kept their own (timed faster)" if faster else "")
            + (f", {parity} kept their own (parity)" if parity else "")
            + "; not bitwise equal to the eager attention, so the loss drifts from "
            "plain's by training noise"
        )
        if self.compile is not None:
            watch = self.compile.watch
            notes.append(
                f"kit: RegionalCompile: {len(self.compile.compiled)} blocks compiled in place, "
                f"{watch.graphs} graphs, {watch.recompiles} recompiles, {watch.seconds:.1f} s "
                f"compiling (in the wall time, not in samples/s)"
            )
        else:
            notes.append(
                "kit: RegionalCompile left out on CPU: the tiny VLM's compiled blocks ran "
                "slower than eager on 2 cores (benchmarks/cpu_step.py; docs/benchmarks.md)"
            )
        kernels = sorted({s.implementation or "unchanged" for s in self.fused.switched})
        notes.append(f"kit: FusedOptimizer: AdamW on its {', '.join(kernels) or 'own'} kernel")
        report = self.profiler.report
        if report is not None:
            kinds = ", ".join(report.kinds) or "nothing stands out"
            notes.append(f"kit: profiled window: {kinds}; report {self.profiler.report_files[0]}")
            notes += [f"  - {f.kind}: {f.fix}" for f in report.findings]
        return notes
