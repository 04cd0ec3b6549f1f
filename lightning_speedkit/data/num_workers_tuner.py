"""NumWorkersTuner: tune the train loader's workers as fit starts; say if data is the bottleneck."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lightning_speedkit import _compat, _validation
from lightning_speedkit.data._switch import switch_loader, why_not_switched
from lightning_speedkit.data.mixin import SpeedDataModuleMixin
from lightning_speedkit.data.worker_search import (
    TuneResult,
    _check_worker_arguments,
    cpu_budget,
    rebuild_dataloader,
    spare_cores,
    tune_num_workers,
)

__all__ = ["NumWorkersTuner"]


class NumWorkersTuner(L.Callback):
    """Measures worker settings for the train loader at the start of ``fit`` and uses the best.

    Works with a LightningDataModule, a loader passed as ``train_dataloaders=`` and,
    best, a DataModule using :class:`~lightning_speedkit.data.SpeedDataModuleMixin`
    (whose own ``train_dataloader`` then builds with the tuned settings, so
    reloading loaders keeps them). Each rank tunes with its share of the cores;
    rank 0's choice is used everywhere. Results are cached per dataset, machine
    and torch version, so a rerun skips the measuring.

    After ``verdict_steps`` training batches it compares the loader's measured
    rate with the rate the model consumes batches at, says whether data loading
    is the bottleneck, and logs ``data/loader_batches_per_sec``,
    ``data/model_batches_per_sec`` and ``data/num_workers``.

    Training on CPU, the search at ``fit`` start leaves torch's threads their
    cores. When the verdict is that data loading holds the model back so far that
    the compute leaves cores idle (:func:`~lightning_speedkit.data.worker_cores.spare_cores`),
    it measures the loader again with workers on those cores, pausing training for
    the search (not when ``max_workers`` is given: that is the most it tries). The
    train loader switches to the best at once, in the middle of the epoch: the samples
    the epoch has not seen yet come from a loader with the new settings, each once, in
    the epoch's order, and later epochs use the loader rebuilt with them. Where the
    epoch cannot change loaders (an ``IterableDataset``, a loader with a ``state_dict``
    for mid-epoch resume), the switch waits for the next epoch; until then ``result``
    names the loader in use, with the faster one as ``result.pending`` and why it waits
    as ``result.pending_reason``.

    ``result`` is always the loader in use: its ``best`` are the train loader's settings.

    Args:
        max_workers: most workers tried; default: the cores the training process
            leaves free (below).
        batches: batches timed per candidate (as for
            :func:`~lightning_speedkit.data.tune_num_workers`, like the next six).
        warmup_batches: batches per candidate left out of its timing.
        min_gain: relative gain a candidate needs over the best so far.
        time_budget: seconds the whole search may take.
        timeout: seconds a worker may take for a batch before its candidate is skipped.
        cache: reuse a result saved for this dataset and machine.
        cache_dir: where results are saved.
        force: measure even when a cached result exists.
        progress: show a progress bar.
        verdict_steps: training batches timed for the bottleneck verdict (after 3
            warm-up batches); 0 turns the verdict off.
        compute_threads: training on CPU, give torch this many threads for the
            model and the rest of the rank's cores to loader workers (restored when
            fit ends). By default torch keeps its threads and workers get only the
            cores left over (until the verdict finds the compute leaving cores
            idle, above); on accelerators one core per rank is kept for
            driving the device. Whether the split pays depends on the model: on a
            shared 2-core machine, one thread plus one worker ran the example VLM
            between 0.8x and 1.15x as fast as two threads and no worker, so it is
            not the default.

    Example::

        >>> import lightning as L
        >>> trainer = L.Trainer(callbacks=[NumWorkersTuner()], logger=False)
    """

    def __init__(
        self,
        max_workers: int | None = None,
        batches: int = 30,
        warmup_batches: int = 3,
        min_gain: float = 0.05,
        time_budget: float = 120.0,
        timeout: float = 30.0,
        cache: bool = True,
        cache_dir: str | None = None,
        force: bool = False,
        progress: bool = True,
        verdict_steps: int = 20,
        compute_threads: int | None = None,
    ) -> None:
        _validation.non_negative_int("verdict_steps", verdict_steps, example=20,
                                     hint="0 turns the verdict off")  # fmt: skip
        self.tune_kwargs: dict[str, Any] = dict(
            max_workers=max_workers, batches=batches, warmup_batches=warmup_batches,
            min_gain=min_gain, time_budget=time_budget, timeout=timeout, cache=cache,
            cache_dir=cache_dir, force=force, progress=progress,
        )  # fmt: skip
        _check_worker_arguments(**self.tune_kwargs)
        _validation.optional(_validation.positive_int, "compute_threads", compute_threads)
        self.verdict_steps = verdict_steps
        self.compute_threads = compute_threads
        self._threads_before: int | None = None
        self.result: TuneResult | None = None
        self.bottleneck: dict[str, Any] | None = None
        self._best: dict[str, Any] = {}
        self._step_times: list[float] = []
        self._t = 0.0
        self._batches = 0
        self._loader: DataLoader[Any] | None = None  # the train loader as tuned at setup
        self._searched = 0  # the most workers the search at setup tried
        self._reload = False  # a loader chosen after the verdict waits for the next epoch
        self._pending: TuneResult | None = None  # ... and what measured it
        self._restore: Callable[[], None] | None = None  # the Trainer's reload setting

    # -- tuning, before Lightning builds the loader --------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._step_times, self._batches, self.bottleneck = [], 0, None
        self._loader, self._reload, self._pending = None, False, None
        _compat.drop_train_loader_change(trainer, "NumWorkersTuner")  # a fit that raised
        source = _compat.train_loader_source(trainer)
        loader = source.dataloader()
        if not isinstance(loader, DataLoader):
            rank_zero_warn(
                f"NumWorkersTuner tunes a single torch DataLoader; the train loader is a "
                f"{type(loader).__name__}, so it is left as it is."
            )
            return
        kwargs = dict(self.tune_kwargs)
        if kwargs["max_workers"] is None:
            kwargs["max_workers"] = self._worker_budget(trainer)
        # On a resume the cache answers at once (same dataset, machine and torch).
        self.result = tune_num_workers(loader, local_world_size=trainer.num_devices, **kwargs)
        self._loader, self._searched = loader, kwargs["max_workers"]
        best = trainer.strategy.broadcast(self.result.best, src=0)
        self._use(trainer, loader, best)
        r = self.result
        gain = ""
        if r.given_batches_per_sec:
            gain = f", {r.best_batches_per_sec / r.given_batches_per_sec:.2f}x the loader as given"
        how = "cached" if r.cached else f"tuned in {r.seconds:.1f} s"
        rank_zero_info(
            f"NumWorkersTuner: {_describe(best)}: {r.best_batches_per_sec:.1f} batches/s"
            f"{gain} ({how})."
        )

    def _use(
        self, trainer: L.Trainer, loader: DataLoader[Any] | None, best: dict[str, Any]
    ) -> None:
        """Make ``best`` the settings the fit loop's next train loader is built with:
        ``loader`` rebuilt, or (None) the next loader the user's hook or ``fit`` gives."""
        datamodule = _compat.datamodule(trainer)
        if isinstance(datamodule, SpeedDataModuleMixin):
            datamodule.speed_loader_kwargs = dict(best)
        else:
            # Loaders the fit loop requests later (`reload_dataloaders_every_n_epochs`, or
            # the switch after the verdict) come from the user's hook: they get it too.
            change = partial(_with_settings, settings=dict(best))
            first = None if loader is None else change(loader)
            _compat.change_train_loader(trainer, "NumWorkersTuner", change, first)
        self._best = dict(best)

    def _worker_budget(self, trainer: L.Trainer) -> int:
        """Cores this rank can give to loader workers without starving the training process."""
        cores = cpu_budget(trainer.num_devices)
        if trainer.strategy.root_device.type != "cpu":
            return max(0, cores - 1)  # one core drives the device
        if self.compute_threads is not None and self.compute_threads != torch.get_num_threads():
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(min(self.compute_threads, cores))
            rank_zero_info(
                f"NumWorkersTuner: torch now computes with {torch.get_num_threads()} of this "
                f"rank's {cores} cores (was {self._threads_before}), leaving the rest to loader "
                f"workers."
            )
        budget = max(0, cores - torch.get_num_threads())
        if budget == 0 and cores == 1:
            rank_zero_info(
                "NumWorkersTuner: training on CPU with one core for this rank, which torch "
                "computes on: a loader worker would only take turns with the model."
            )
        elif budget == 0:
            rank_zero_info(
                f"NumWorkersTuner: training on CPU, torch's {torch.get_num_threads()} threads use "
                f"all {cores} of this rank's cores, so no loader worker would get a core of its "
                f"own, unless the verdict finds the model leaving cores idle; pass "
                f"`compute_threads` (fewer than {cores}) to leave some to workers from the start."
            )
        return budget

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_reload_setting()
        if stage == "fit":  # the next fit requests the user's loaders as they are
            _compat.drop_train_loader_change(trainer, "NumWorkersTuner")
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning calls no teardown after a raise

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._best:
            return
        metrics = {"data/num_workers": float(self._best.get("num_workers", 0))}
        if self.result is not None:
            metrics["data/loader_batches_per_sec"] = self.result.best_batches_per_sec
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # -- the verdict: loader rate against the model's consumption rate -------------------------

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._t = _clock()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.verdict_steps == 0 or self.bottleneck is not None or self.result is None:
            return
        self._batches += 1
        if self._batches > 3:  # host time of the step; on CUDA, the pace the host keeps
            self._step_times.append(_clock() - self._t)
        if len(self._step_times) >= self.verdict_steps:
            model_rate = 1.0 / statistics.median(self._step_times)
            loader_rate = self.result.best_batches_per_sec
            bound = loader_rate < model_rate
            self.bottleneck = {
                "data_bound": bound,
                "loader_batches_per_sec": loader_rate,
                "model_batches_per_sec": model_rate,
            }
            margin = f" ({model_rate / loader_rate:.1f}x)" if bound and loader_rate > 0 else ""
            rank_zero_info(
                "NumWorkersTuner: data loading "
                + ("IS the bottleneck" if bound else "is not the bottleneck")
                + f": the loader delivers {loader_rate:.1f} batches/s, the model consumes "
                f"{model_rate:.1f}{margin}." + (_ADVICE if bound else "")
            )
            for logger in trainer.loggers:
                logger.log_metrics(
                    {"data/model_batches_per_sec": model_rate}, step=trainer.global_step
                )
            found = self._spare_cores_search(trainer, model_rate) if bound else None
            faster = None if found is None else found.to_json()
            if trainer.world_size > 1:
                # One collective, once per fit, on every rank at the same batch: rank 0's
                # result (or None) for all, as at setup.
                faster = trainer.strategy.broadcast(faster, src=0)
            if faster is not None and self._loader is not None:
                self._switch(trainer, self.result, TuneResult(**faster))

    def _switch(self, trainer: L.Trainer, in_use: TuneResult, found: TuneResult) -> None:
        """Train on ``found.best`` from the next batch on: the rest of this epoch loaded
        with it, or, where the epoch cannot change loaders, from the next epoch."""
        self._use(trainer, None, found.best)  # the loaders the loop requests later get it too
        running = _compat.train_loader_running(trainer)
        why = "the fit loop trains on several loaders" if running is None else None
        if running is not None:
            why = why_not_switched(*running)
        if running is not None and why is None:
            loader, rest = switch_loader(running[0], running[1], found.best)
            _compat.continue_train_epoch(trainer, loader, rest)
            self.result = found
            when = "now, for the samples this epoch has not seen yet"
        else:
            # `result` stays the loader in use; the faster one waits, and says why.
            self._pending = found
            self.result = replace(in_use, pending=dict(found.best), pending_reason=why)
            self._reload = True
            when = f"at the next epoch ({why})"
        rank_zero_info(f"NumWorkersTuner: the train loader switches to it {when}.")
        for logger in trainer.loggers:
            logger.log_metrics(
                {"data/num_workers": float(found.best["num_workers"])}, step=trainer.global_step
            )

    def _spare_cores_search(self, trainer: L.Trainer, model_rate: float) -> TuneResult | None:
        """Measure workers on the cores the compute leaves idle; the new result, or None.

        Training on CPU, the search at setup left torch's threads their cores. Data
        loading far behind the model means the compute needs fewer: measure what giving
        the rest to workers is worth (rank 0 measures; training waits for it).
        """
        if (
            trainer.global_rank != 0
            or self._loader is None
            or self.result is None
            or self.tune_kwargs["max_workers"] is not None  # the user's ceiling
            or trainer.strategy.root_device.type != "cpu"
        ):
            return None
        cores = cpu_budget(trainer.num_devices)
        threads = torch.get_num_threads()
        per_process = self.result.best_batches_per_sec / max(1, self._best.get("num_workers", 0))
        spare = spare_cores(cores, threads, model_rate, per_process)
        if spare <= self._searched:
            return None
        rank_zero_info(
            f"NumWorkersTuner: at the loader's pace the model needs about "
            f"{threads * min(1.0, cores * per_process / model_rate):.2g} of this rank's {cores} "
            f"cores, not the {min(threads, cores)} its threads were left; measuring loader "
            f"workers on {spare} cores (training waits)."
        )
        kwargs = {**self.tune_kwargs, "max_workers": spare}
        result = tune_num_workers(self._loader, local_world_size=trainer.num_devices, **kwargs)
        if result.best == self._best or result.best_batches_per_sec <= 0:
            rank_zero_info(
                f"NumWorkersTuner: no setting beat {_describe(self._best)}; the loader stays."
            )
            return None
        gain = f"{result.best_batches_per_sec / self.result.best_batches_per_sec:.2f}x"
        rank_zero_info(
            f"NumWorkersTuner: {_describe(result.best)}: {result.best_batches_per_sec:.1f} "
            f"batches/s, {gain} the loader in use."
        )
        return result

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._reload:  # after the epoch's validation, so only the train loader reloads
            self._reload = False
            self._restore = _compat.reload_train_loader_next_epoch(trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._restore is not None and self._pending is not None:
            self.result, self._pending = self._pending, None  # the loader in use now
        self._restore_reload_setting()  # the loop has built this epoch's loader

    def _restore_reload_setting(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None


def _with_settings(loader: Any, settings: dict[str, Any]) -> Any:
    """A train loader with the tuned settings: rebuilt, unless it has them already."""
    if not isinstance(loader, DataLoader):
        return loader  # as at setup: only a single torch DataLoader is tuned
    if all(getattr(loader, key) == value for key, value in settings.items()):
        return loader  # its own settings: kept as it is (a stateful subclass stays one)
    return rebuild_dataloader(loader, **settings)


#: The clock the verdict times training steps with (a test can set its own).
_clock = time.perf_counter


_ADVICE = " Consider more CPU for decoding, lighter transforms, or pre-decoded data."


def _describe(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items() if v is not None)
