"""Giving the fit loop's train loader other worker settings: the loader built at setup,
the loaders the loop requests later, and the rest of an epoch under way. NumWorkersTuner
decides when; this module does it, through the few private Trainer names in ``_compat``."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lightning_speedkit import _compat
from lightning_speedkit.data._epoch_draws import UntunedDraws, adopt
from lightning_speedkit.data._switch import switch_loader, why_not_switched
from lightning_speedkit.data._verdict import not_tuned_message
from lightning_speedkit.data.mixin import SpeedDataModuleMixin, built_by_speed_dataloader
from lightning_speedkit.data.rebuild import rebuild_dataloader
from lightning_speedkit.data.tune_result import TuneResult

#: The name the tuner's change of the train loader goes by in the fit loop's source.
OWNER = "NumWorkersTuner"

#: Each fit's draws of its train loader as given (see `keep_epoch_draws`), by Trainer.
_DRAWS: weakref.WeakKeyDictionary[L.Trainer, UntunedDraws] = weakref.WeakKeyDictionary()
#: Each fit's stateful train loader as given, for a resume (see `_CheckpointWorkers`).
_RESUMES: weakref.WeakKeyDictionary[L.Trainer, _Resume] = weakref.WeakKeyDictionary()


def loader_to_tune(trainer: L.Trainer) -> DataLoader[Any] | None:
    """The train loader NumWorkersTuner measures at fit start; None, said why, where there
    is none to tune: a ``fast_dev_run`` (a smoke test of a batch or a few, which the
    search would outlast many times over), ``limit_train_batches=0`` (no batch trains),
    or a loader that is not one torch DataLoader."""
    if (reason := _compat.trains_no_batch(trainer)) is not None:
        rank_zero_info(f"{OWNER}: {reason}.")
        return None
    loader = _compat.train_loader_source(trainer).dataloader()
    if not isinstance(loader, DataLoader):
        rank_zero_warn(not_tuned_message(loader))
        return None
    return loader


def with_settings(loader: Any, settings: dict[str, Any]) -> Any:
    """A train loader with the tuned settings: rebuilt, unless it has them already."""
    if not isinstance(loader, DataLoader):
        return loader  # as at setup: only a single torch DataLoader is tuned
    if all(getattr(loader, key) == value for key, value in settings.items()):
        return loader  # its own settings: kept as it is (a stateful subclass stays one)
    return adopt(rebuild_dataloader(loader, **settings))


def use_settings(trainer: L.Trainer, loader: DataLoader[Any] | None, best: dict[str, Any]) -> None:
    """Make ``best`` the settings the fit loop's next train loader is built with:
    ``loader`` rebuilt, or (None) the next loader the user's hook or ``fit`` gives."""
    if loader is not None:  # the fit's start: the loader as given, whose draws are kept
        _DRAWS[trainer] = UntunedDraws(loader)
    datamodule = _compat.datamodule(trainer)
    if isinstance(datamodule, SpeedDataModuleMixin):
        datamodule.speed_loader_kwargs = dict(best)  # speed_dataloader builds with them,
        if loader is None or built_by_speed_dataloader(loader):  # inside Lightning's hook
            return  # (where Lightning can build it again around a distributed sampler)
    # Loaders the fit loop requests later (`reload_dataloaders_every_n_epochs`, or the
    # switch after the verdict) come from the user's hook: they get it too, a plain
    # DataLoader a mixin's hook builds included (it was left with its own settings).
    change = partial(with_settings, settings=dict(best))
    first = None if loader is None else change(loader)
    _compat.change_train_loader(trainer, OWNER, change, first)
    if loader is not None and callable(getattr(loader, "load_state_dict", None)):
        # A checkpoint may hold its state, taken under other workers than the tuned ones.
        _RESUMES[trainer] = _Resume(loader, change, best["num_workers"])
        _compat.add_callback_once(trainer, _CheckpointWorkers())


def saved_workers(state: Any) -> int | None:
    """The workers a torchdata ``StatefulDataLoader`` had when it saved ``state`` (its
    format: an in-process loader's state counts what it yielded, a multi-process one holds
    a snapshot of the main process); None for another loader's state."""
    if not isinstance(state, dict):
        return None
    if "_num_yielded" in state:
        return 0
    snapshot = state.get("_snapshot")
    main = snapshot.get("_main_snapshot") if isinstance(snapshot, dict) else None
    workers = main.get("_num_workers") if isinstance(main, dict) else None
    return workers if isinstance(workers, int) else None


class _Resume:
    """A fit's train loader with a ``state_dict``, as given, and the tuner's change to it."""

    def __init__(self, given: DataLoader[Any], change: Callable[[Any], Any], workers: int) -> None:
        self.given, self.change, self.workers = given, change, workers  # workers: tuned
        self.waiting = False  # the tuned loader waits for the epoch after the resumed one
        self.restore: Callable[[], None] | None = None  # the Trainer's reload setting


class _CheckpointWorkers(L.Callback):
    """Resumes a stateful train loader with the workers its checkpoint was taken with.

    torchdata's ``StatefulDataLoader`` refuses a state saved under another worker count
    (``AssertionError: State doesn't contain key ...``), and the tuner's pick differs from
    the checkpoint's wherever it measures again: another machine, ``force=True``,
    ``cache=False``. The epoch the fit resumes in trains on the loader rebuilt with the
    checkpoint's workers; the fit loop requests its train loader again as the next epoch
    starts, and gets the tuned one. NumWorkersTuner adds it to the Trainer at setup.
    """

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:  # fmt: skip
        resume = _RESUMES.get(trainer)
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
        states = fit_loop.get("state_dict", {}).get("combined_loader") or []
        if resume is None or len(states) != 1:
            return
        saved = saved_workers(states[0])
        if saved is None or saved == resume.workers:
            return
        prefetch = resume.given.prefetch_factor if resume.given.num_workers else 2
        again = rebuild_dataloader(resume.given, num_workers=saved, persistent_workers=False,
                                   prefetch_factor=prefetch if saved else None)  # fmt: skip
        _compat.change_train_loader(trainer, OWNER, resume.change, again)
        resume.waiting = True
        rank_zero_info(
            f"{OWNER}: the checkpoint's train loader state was saved with num_workers={saved}, "
            f"and a {type(again).__name__} resumes it only with as many; the resumed epoch "
            f"keeps {saved}, the next one starts with the tuned num_workers={resume.workers}."
        )

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        resume = _RESUMES.get(trainer)
        if resume is not None and resume.waiting:  # after the epoch's validation
            resume.waiting = False
            resume.restore = _compat.reload_train_loader_next_epoch(trainer)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._put_back(trainer)  # the loop has requested the tuned loader

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._put_back(trainer)
        _RESUMES.pop(trainer, None)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        self.teardown(trainer, pl_module, "fit")  # Lightning calls no teardown after a raise

    @staticmethod
    def _put_back(trainer: L.Trainer) -> None:
        """The Trainer's reload setting as it was, unless the tuner's own switch to the
        next epoch's loader (set before this callback's) has put it back already."""
        resume = _RESUMES.get(trainer)
        if resume is not None and resume.restore is not None:
            if getattr(trainer, "reload_dataloaders_every_n_epochs", 0) == 1:  # still ours
                resume.restore()
            resume.restore = None


def keep_epoch_draws(trainer: L.Trainer, given: DataLoader[Any] | None) -> None:
    """As an epoch ends, leave the random generators the train loader draws from where
    ``given`` (the loader as the user gave it) would leave them as the next epoch starts.

    Persistent workers draw one base seed for the fit where ``given`` drew one an epoch,
    and workers run the sampler past its end each epoch where Lightning stops an
    in-process loader at its length: with a seeded shuffle, every epoch from the second
    on had another order than untuned. The epoch's draws are replayed as ``given`` makes
    them (:class:`~lightning_speedkit.data._epoch_draws.UntunedDraws`). Nothing is drawn
    after the last epoch.
    """
    draws = _DRAWS.get(trainer)
    if draws is None or draws.given is not given or trainer.should_stop:
        return
    if trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs:
        return
    every = getattr(trainer, "reload_dataloaders_every_n_epochs", 0)  # set on the Trainer
    reloads = bool(every) and (trainer.current_epoch + 1) % every == 0
    draws.epoch_ended(trainer.train_dataloader, trainer.num_training_batches, reloads)


def switch_running_epoch(trainer: L.Trainer, settings: dict[str, Any]) -> str | None:
    """Load the rest of the epoch under way with ``settings`` (and later epochs from the
    loader rebuilt with them); None once done, else why the epoch cannot change loaders."""
    running = _compat.train_loader_running(trainer)
    if running is None:
        return "the fit loop trains on several loaders"
    why = why_not_switched(*running)
    if why is not None:
        return why
    loader, rest = switch_loader(running[0], running[1], settings)
    _compat.continue_train_epoch(trainer, adopt(loader, starts_an_epoch=False), rest)
    draws = _DRAWS.get(trainer)
    if draws is not None:
        draws.switched = True  # the rest of the epoch ran its sampler otherwise
    return None


class NextEpochSwitch:
    """A faster loader that the epoch under way cannot take, waiting for the next epoch.

    :meth:`wait` holds it; at the end of the epoch (after its validation, so only the train
    loader reloads) the fit loop is told to request its train loader again, which the
    settings given to :func:`use_settings` then build; once the next epoch has started,
    the Trainer's reload setting is put back and the waiting result is handed over.
    """

    def __init__(self) -> None:
        self.waiting: TuneResult | None = None
        self._armed = False
        self._restore: Callable[[], None] | None = None  # the Trainer's reload setting

    def forget(self) -> None:
        """Drop what waits (a new fit starts)."""
        self.waiting, self._armed = None, False

    def wait(self, found: TuneResult) -> None:
        """Use ``found`` from the next epoch on."""
        self.waiting, self._armed = found, True

    def epoch_ended(self, trainer: L.Trainer) -> None:
        """Have the fit loop build its train loader again for the next epoch, if one waits."""
        if self._armed:
            self._armed = False
            self._restore = _compat.reload_train_loader_next_epoch(trainer)

    def epoch_started(self) -> TuneResult | None:
        """The result the epoch now starting trains with, if it was waiting; the Trainer's
        reload setting is put back (the loop has built this epoch's loader)."""
        found = self.waiting if self._restore is not None else None
        if found is not None:
            self.waiting = None
        self.restore()
        return found

    def restore(self) -> None:
        """Put the Trainer's reload setting back, if it was changed."""
        if self._restore is not None:
            self._restore()
            self._restore = None
