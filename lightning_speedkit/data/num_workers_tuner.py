"""NumWorkersTuner: tune the train loader's workers as fit starts; say if data is the bottleneck."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lightning_speedkit import _compat, _validation
from lightning_speedkit._loggers import log_metrics
from lightning_speedkit._paused import paused
from lightning_speedkit.data import _verdict
from lightning_speedkit.data._compute_threads import ComputeThreads
from lightning_speedkit.data._train_loader import (
    OWNER,
    NextEpochSwitch,
    keep_epoch_draws,
    loader_to_tune,
    switch_running_epoch,
    use_settings,
)
from lightning_speedkit.data.tune_result import TuneResult, measured
from lightning_speedkit.data.worker_cores import cpu_budget
from lightning_speedkit.data.worker_search import _check_worker_arguments, tune_num_workers

__all__ = ["NumWorkersTuner"]


class NumWorkersTuner(L.Callback):
    """Measures worker settings for the train loader at the start of ``fit`` and uses the best.

    Works with a LightningDataModule, a loader passed as ``train_dataloaders=`` and,
    best, a DataModule using :class:`~lightning_speedkit.data.SpeedDataModuleMixin`
    (whose own ``train_dataloader`` then builds with the tuned settings, so
    reloading loaders keeps them). Each rank tunes with its share of the cores;
    rank 0's choice is used everywhere. Results are cached per dataset, machine
    and torch version, so a rerun skips the measuring.

    After 3 warm-up training batches and ``verdict_steps`` timed ones it compares the
    loader's measured rate with the rate the model consumes batches at, says whether
    data loading is the bottleneck, and logs ``data/loader_batches_per_sec``,
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
        self._threads = ComputeThreads()  # torch's, while `compute_threads` holds
        self.result: TuneResult | None = None
        self._best: dict[str, Any] = {}
        self._t = 0.0
        self._next_epoch = NextEpochSwitch()  # a loader chosen after the verdict, waiting
        self._forget_fit()

    def _forget_fit(self) -> None:
        """What one fit measured and waits for, cleared before the next."""
        self.bottleneck: dict[str, Any] | None = None
        self._pace = _verdict.StepPace(self.verdict_steps)
        self._loader: DataLoader[Any] | None = None  # the train loader as tuned at setup
        self._searched = 0  # the most workers the search at setup tried
        self._next_epoch.forget()

    # -- tuning, before Lightning builds the loader --------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._forget_fit()
        _compat.drop_train_loader_change(trainer, OWNER)  # a fit that raised
        loader = loader_to_tune(trainer)  # None: not tuned, and said why
        if loader is None:
            return
        kwargs = dict(self.tune_kwargs)
        if kwargs["max_workers"] is None:
            kwargs["max_workers"] = self._worker_budget(trainer)
        # Cached only where this machine measured it (a resume elsewhere: _CheckpointWorkers)
        self.result = tune_num_workers(loader, local_world_size=trainer.num_devices, **kwargs)
        self._loader, self._searched = loader, kwargs["max_workers"]
        best = trainer.strategy.broadcast(self.result.best, src=0)
        use_settings(trainer, loader, best)
        self._best = dict(best)
        rank_zero_info(_verdict.tuned_message(self.result, best))

    def _worker_budget(self, trainer: L.Trainer) -> int:
        """Cores this rank can give to loader workers without starving the training process."""
        cores = cpu_budget(trainer.num_devices)
        on_cpu = trainer.strategy.root_device.type == "cpu"
        said = None
        if on_cpu and self.compute_threads is not None:
            said = self._threads.give(self.compute_threads, cores)
        budget, why_none = _verdict.worker_budget(cores, on_cpu, torch.get_num_threads())
        for message in filter(None, (said, why_none)):
            rank_zero_info(message)
        return budget

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._next_epoch.restore()
        if stage == "fit":  # the next fit requests the user's loaders as they are
            _compat.drop_train_loader_change(trainer, OWNER)
        self._threads.restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning calls no teardown after a raise

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._best:
            log_metrics(trainer, _verdict.start_metrics(self._best, self.result))

    # -- the verdict: loader rate against the model's consumption rate -------------------------

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._t = _clock()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.verdict_steps == 0 or self.bottleneck is not None or not measured(self.result):
            return
        # Host time of the step; on CUDA, the pace the host keeps.
        if not self._pace.add(_clock() - self._t if self._pace.timing() else None):
            return
        self.bottleneck = _verdict.verdict(self._pace.times, self.result.best_batches_per_sec)
        rank_zero_info(_verdict.verdict_message(self.bottleneck))
        model_rate = self.bottleneck["model_batches_per_sec"]
        log_metrics(trainer, {"data/model_batches_per_sec": model_rate})
        bound = self.bottleneck["data_bound"]
        with paused(trainer):  # rank 0 may search; every rank waits for it
            found = self._spare_cores_search(trainer, model_rate) if bound else None
            faster = None if found is None else found.to_json()
            if trainer.world_size > 1:
                # One collective, once per fit, on every rank at the same batch: rank 0's
                # result (or None) for all, as at setup.
                faster = trainer.strategy.broadcast(faster, src=0)
        if faster is not None and self._loader is not None:
            self._switch(trainer, self.result, TuneResult(**faster))

    def _spare_cores_search(self, trainer: L.Trainer, model_rate: float) -> TuneResult | None:
        """Measure workers on the cores the compute leaves idle; the new result, or None.

        Training on CPU, the search at setup left torch's threads their cores. Data
        loading far behind the model means the compute needs fewer: measure what giving
        the rest to workers is worth (rank 0 measures; training waits for it).
        """
        on_cpu_rank_zero = trainer.global_rank == 0 and trainer.strategy.root_device.type == "cpu"
        if not on_cpu_rank_zero or self._loader is None or self.result is None:
            return None
        if self.tune_kwargs["max_workers"] is not None:  # the user's ceiling
            return None
        return _verdict.search_spare_cores(
            self._loader, replace(self.result, best=self._best), model_rate,
            cores=cpu_budget(trainer.num_devices), threads=torch.get_num_threads(),
            searched=self._searched,
            tune_kwargs={**self.tune_kwargs, "local_world_size": trainer.num_devices},
        )  # fmt: skip

    def _switch(self, trainer: L.Trainer, in_use: TuneResult, found: TuneResult) -> None:
        """Train on ``found.best`` from the next batch on: the rest of this epoch loaded
        with it, or, where the epoch cannot change loaders, from the next epoch."""
        use_settings(trainer, None, found.best)  # the loaders the loop requests later get it
        self._best = dict(found.best)
        why = switch_running_epoch(trainer, found.best)
        if why is None:
            self.result = found
            when = "now, for the samples this epoch has not seen yet"
        else:
            # `result` stays the loader in use; the faster one waits, and says why.
            self._next_epoch.wait(found)
            self.result = replace(in_use, pending=dict(found.best), pending_reason=why)
            when = f"at the next epoch ({why})"
        rank_zero_info(f"NumWorkersTuner: the train loader switches to it {when}.")
        log_metrics(trainer, {"data/num_workers": float(found.best["num_workers"])})

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._next_epoch.waiting is None:  # else the next epoch builds its loader anew
            keep_epoch_draws(trainer, self._loader)  # before the next epoch's shuffle
        self._next_epoch.epoch_ended(trainer)  # after the epoch's validation

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        found = self._next_epoch.epoch_started()
        if found is not None:
            self.result = found  # the loader in use now


#: The clock the verdict times training steps with (a test can set its own).
_clock = time.perf_counter
