"""Lightning's trainer and fit loop: loaders, accumulation, callbacks, the process group's store."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import lightning as L
import torch


def logged_step(trainer: L.Trainer) -> int:
    """The step Lightning's rows of a training batch carry (its loop's batches that stepped
    the optimizers, before this batch's: one per batch, whatever the optimizers)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def lightning_logs_now(trainer: L.Trainer) -> bool:
    """Whether Lightning writes its logged metrics at the end of this training batch (its
    ``log_every_n_steps`` cadence, in batches that step), and this batch steps the
    optimizers (the last of an accumulation window: where it writes its last row)."""
    due = bool(trainer._logger_connector.should_update_logs)
    return due and not trainer.fit_loop.epoch_loop._should_accumulate()


def train_loader_source(trainer: L.Trainer) -> Any:
    """Where the fit loop will request its train loader (Lightning's ``_DataLoaderSource``).

    It has ``dataloader()`` (calls the DataModule's or LightningModule's hook, or returns
    the loader passed to ``fit``), and ``instance``/``name``, which decide what is called.
    """
    return trainer.fit_loop._data_source


def trains_no_batch(trainer: L.Trainer) -> str | None:
    """Why this fit trains too few batches to tune its loader for, or None: a
    ``fast_dev_run`` (a smoke test that a search would outlast many times over) or
    ``limit_train_batches=0`` (no batch trains)."""
    if getattr(trainer, "fast_dev_run", False):  # not in the Trainer's stubs
        return "not tuning in a `fast_dev_run` (a smoke test); the train loader runs as given"
    if trainer.limit_train_batches == 0:  # 0 or 0.0: the fit loop trains no batch
        return "`limit_train_batches=0`, no batch trains; not tuning"
    return None


class _ChangedTrainSource:
    """The fit loop's train-loader source with a callback's change to every loader it gives.

    Stands in for Lightning's ``_DataLoaderSource`` (``dataloader()``, ``is_defined()``,
    ``is_module()``, ``instance``, ``name``) in front of the one it replaced (``inner``),
    so a loader the loop requests later (``reload_dataloaders_every_n_epochs``, or a
    callback's own reload) still comes from the user's hook, and is changed as the
    first was. The loader the tuner built is served at the first request; each later
    request calls the inner source, as Lightning's own would. ``instance`` is the inner
    source's, and setting it (Lightning does, when ``fit`` attaches its data) sets the
    inner one's.
    """

    def __init__(self, inner: Any, owner: str, change: Callable[[Any], Any]) -> None:
        self.inner, self.owner, self.change = inner, owner, change
        self._next: Any = None  # served at the next request

    @property
    def instance(self) -> Any:
        return self.inner.instance

    @instance.setter
    def instance(self, value: Any) -> None:
        self.inner.instance = value

    @property
    def name(self) -> str:
        return str(self.inner.name)

    def is_defined(self) -> bool:
        return bool(self.inner.is_defined())

    def is_module(self) -> bool:
        return bool(self.inner.is_module())

    def dataloader(self) -> Any:
        if self._next is not None:
            loader, self._next = self._next, None
            return loader
        return self.change(self.inner.dataloader())


def change_train_loader(
    trainer: L.Trainer,
    owner: str,
    change: Callable[[Any], Any],
    loader: Any = None,
    *,
    before_loop: bool = False,
) -> None:
    """Make the fit loop train on ``loader``, and on ``change(new)`` for every loader it
    requests later.

    ``owner`` (a callback's name) names the change: a second call by the same owner
    replaces its change rather than adding one, and :func:`drop_train_loader_change`
    takes it out. Changes by different owners compose, the later applied last.
    ``loader`` None: the next request already goes through ``change``.

    ``before_loop`` (a callback's ``on_fit_start``, before the fit loop runs): a loader
    the loop has already built is dropped, with its fetcher, so that it builds
    ``loader``. Reading ``trainer.estimated_stepping_batches`` in ``configure_optimizers``
    (warm-up and OneCycle schedules) builds the train loader that early. Later, the
    loader being iterated stays until the loop reloads (see
    :func:`reload_train_loader_next_epoch`).
    """
    loop = trainer.fit_loop
    source = loop._data_source
    mine: Any = source
    while isinstance(mine, _ChangedTrainSource) and mine.owner != owner:
        mine = mine.inner
    if not isinstance(mine, _ChangedTrainSource):
        mine = _ChangedTrainSource(source, owner, change)
        loop._data_source = mine  # a stand-in for Lightning's
    mine.change, mine._next = change, loader
    if before_loop and loop._combined_loader is not None:
        if loop._data_fetcher is not None:
            loop._data_fetcher.teardown()  # its iterator may hold worker processes
            loop._data_fetcher = None
        loop._combined_loader = None


def drop_train_loader_change(trainer: L.Trainer, owner: str) -> None:
    """Take ``owner``'s change (:func:`change_train_loader`) out of the fit loop's source.

    Call it when the fit ends, and before a new fit sets its own: the loaders Lightning
    requests then are the user's again.
    """
    loop = trainer.fit_loop
    above: Any = None
    source = loop._data_source
    while isinstance(source, _ChangedTrainSource):
        if source.owner == owner:
            if above is None:
                loop._data_source = source.inner
            else:
                above.inner = source.inner
            return
        above, source = source, source.inner


def train_combined_loader(trainer: L.Trainer) -> Any:
    """The fit loop's CombinedLoader (Lightning wraps every train loader, or dict or list
    of loaders, in one); None before the loop has built it."""
    return trainer.fit_loop._combined_loader


def combined_loader_mode(loader: Any) -> str:
    """A CombinedLoader's mode: ``"max_size_cycle"``, ``"min_size"``, ``"max_size"`` or
    ``"sequential"`` (only its constructor takes it; nothing reads it back publicly)."""
    return str(loader._mode)


def dataloader_built_again(loader: Any, changes: dict[str, Any]) -> Any | None:
    """``loader``'s own class constructed again from its own arguments, but ``changes``.

    The arguments are those Lightning records for a loader made in a ``*_dataloader``
    hook (``__pl_saved_args``); for a loader made elsewhere, the attributes named as
    the constructor's parameters, and only when every parameter the class adds to
    DataLoader's is kept under its own name. The new loader is made the way a hook's
    is, so that Lightning can build it again around a ``DistributedSampler`` too.

    None when the arguments cannot be recovered, the class refuses them, or the loader
    it makes does not have exactly ``changes`` (a subclass that transforms an argument,
    ``batch_size * 2``): the caller then builds a torch DataLoader.
    """
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from torch.utils.data import BatchSampler, DataLoader

    cls = type(loader)
    parameters = inspect.signature(cls.__init__).parameters
    named = {n: p for n, p in list(parameters.items())[1:]
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}  # fmt: skip
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    if hasattr(loader, "__pl_saved_args"):
        args = tuple(getattr(loader, "__pl_saved_args"))
        names = tuple(getattr(loader, "__pl_saved_arg_names"))
        if len(args) != len(names):  # positional arguments that cannot be named
            return None
        kwargs = {**dict(zip(names, args, strict=True)), **getattr(loader, "__pl_saved_kwargs")}
    else:
        own = set(named) - set(inspect.signature(DataLoader.__init__).parameters)
        kept = vars(loader)
        if not own <= set(kept):  # an argument of the subclass's that it keeps nowhere
            return None
        readable = {"multiprocessing_context": loader.multiprocessing_context, **kept}
        kwargs = {n: readable[n] for n in named if n in readable}
        # A loader keeps both its batch sampler and what made it; it takes one or the other:
        # the batch sampler where it was given one (it has no batch size then), else what
        # made its batches (batch_size=None, batching off, has no batch sampler at all).
        given = loader.batch_sampler is not None and loader.batch_size is None
        made_by = _BATCHING if given else ("batch_sampler",)
        for name in made_by:
            kwargs.pop(name, None)
    kwargs.update(changes)
    if not takes_any and not set(kwargs) <= set(named):
        return None
    if any(p.default is p.empty and n not in kwargs for n, p in named.items()):
        return None
    try:
        with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
            again = cls(**kwargs)
    except (TypeError, ValueError):
        return None
    placeholders = {"batch_size", "drop_last"} if changes.get("batch_sampler") else set()
    for key, value in changes.items():
        if key == "shuffle" or key in placeholders or (value is None and key in _MADE_WHEN_NONE):
            continue  # the sampler tells `shuffle`, the batch sampler the batch size; defaults
        made = getattr(again, key, None)
        if made is not value and made != value:
            return None
    return again


#: What a loader given a batch sampler takes from it instead (DataLoader refuses both).
_BATCHING = ("batch_size", "drop_last", "sampler", "shuffle")

#: DataLoader arguments that, given as None, the loader fills in itself.
_MADE_WHEN_NONE = frozenset({"sampler", "batch_sampler", "prefetch_factor"})


def metric_state(metric: Any) -> dict[str, Any]:
    """A torchmetrics ``Metric``'s accumulated state (what ``add_state`` declared) and the
    caches its ``update`` and ``compute`` keep, by attribute name: ``setattr`` each back
    to put the metric where it was."""
    names = [*metric._defaults, "_update_count", "_computed", "_forward_cache"]
    return {name: getattr(metric, name) for name in names if hasattr(metric, name)}


def reload_train_loader_next_epoch(trainer: L.Trainer) -> Callable[[], None]:
    """Make the fit loop request its train loader again when the next epoch starts.

    Through Lightning's own switch, the Trainer's ``reload_dataloaders_every_n_epochs``
    (which its stubs do not declare), set to 1 until the returned function puts the
    user's value back: call that once the next epoch has started
    (``on_train_epoch_start``, after the loop has reloaded). Call this after the
    epoch's validation (``on_train_epoch_end``), or the validation loaders reload too.
    """
    before = getattr(trainer, "reload_dataloaders_every_n_epochs", 0)
    trainer.reload_dataloaders_every_n_epochs = 1  # type: ignore[attr-defined]

    def restore() -> None:
        trainer.reload_dataloaders_every_n_epochs = before  # type: ignore[attr-defined]

    return restore


def before_batch_transfer(trainer: L.Trainer, batch: Any) -> Any:
    """``on_before_batch_transfer`` of a train batch as Lightning's loops call it: the
    DataModule's where it overrides the hook, else the LightningModule's."""
    return trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)


def datamodule(trainer: L.Trainer) -> Any:
    """The Trainer's DataModule or None (a property Lightning's stubs do not declare)."""
    return getattr(trainer, "datamodule", None)


def add_callback_once(trainer: L.Trainer, callback: L.Callback) -> None:
    """Append ``callback`` to the Trainer's callbacks unless one of its type is there.

    Strategies use it from ``setup_environment``, which Lightning runs before it
    restores callback state from a checkpoint.
    """
    callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    if not any(type(c) is type(callback) for c in callbacks):
        callbacks.append(callback)


def take_over_accumulation(
    trainer: L.Trainer,
    window_done: Callable[[], bool],
    window_starts: Callable[[], bool],
    active: Callable[[], bool] = lambda: True,
) -> Callable[[], None]:
    """Let the caller decide where gradient-accumulation windows start and end, while
    ``active``; Lightning's own decides while not (a tuner's sweep, which runs the fit
    loop with its own callbacks only: the caller's hooks do not run to count windows).

    Lightning decides both with ``batch_idx % accumulate_grad_batches`` counted from the
    start of each epoch, so a factor changed mid-epoch puts a window's edges in the wrong
    places (stale gradients carried into the next step). Two methods decide:

    - ``_TrainingEpochLoop._accumulated_batches_reached()``: "does this batch close a
      window" (everything else -- ``_should_accumulate``, DDP's ``no_sync``, checkpoint
      and logger step counting -- derives from it);
    - ``_AutomaticOptimization._make_zero_grad_fn(batch_idx, optimizer)``: "does this
      batch open one" (zero the gradients first).

    Both are replaced on the loop instances; ``accumulate_grad_batches`` keeps its other
    job, the loss divisor. Returns the function that puts Lightning's own back.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    automatic = epoch_loop.automatic_optimization
    for owner, name in ((epoch_loop, "_accumulated_batches_reached"),
                        (automatic, "_make_zero_grad_fn")):  # fmt: skip
        if not callable(getattr(owner, name, None)):
            raise RuntimeError(
                f"This Lightning ({L.__version__}) has no `{type(owner).__name__}.{name}`, which "
                f"AccumulationScheduler drives. It is tested with Lightning 2.x up to 2.6; "
                f"please report the version."
            )
    lightning_zero_grad_fn = automatic._make_zero_grad_fn
    lightning_batches_reached = epoch_loop._accumulated_batches_reached

    def make_zero_grad_fn(batch_idx: int, optimizer: Any) -> Callable[[], None] | None:
        if not active():
            return lightning_zero_grad_fn(batch_idx, optimizer)
        if not window_starts():
            return None
        divisor = trainer.accumulate_grad_batches
        trainer.accumulate_grad_batches = 1  # Lightning's own check then says "zero now"
        try:
            return lightning_zero_grad_fn(batch_idx, optimizer)
        finally:
            trainer.accumulate_grad_batches = divisor

    def accumulated_batches_reached() -> bool:
        return window_done() if active() else lightning_batches_reached()

    epoch_loop._accumulated_batches_reached = accumulated_batches_reached  # type: ignore[method-assign]
    automatic._make_zero_grad_fn = make_zero_grad_fn  # type: ignore[method-assign]

    def restore() -> None:
        epoch_loop.__dict__.pop("_accumulated_batches_reached", None)
        automatic.__dict__.pop("_make_zero_grad_fn", None)

    return restore


def default_process_group_store() -> Any:
    """The rendezvous store of torch.distributed's default process group; None without one.

    torch keeps it private (``distributed_c10d._get_default_store``); HangWatchdog talks
    to the other ranks through it, outside every collective.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get_store is None:
        raise RuntimeError(
            f"This torch ({torch.__version__}) has no "
            f"`torch.distributed.distributed_c10d._get_default_store`, which HangWatchdog "
            f"uses to reach the other ranks. It is tested with torch 2.x up to 2.13; please "
            f"report the version, and remove HangWatchdog from the Trainer meanwhile."
        )
    return get_store()


def torch_profiler_enabled() -> bool:
    """Whether a torch.profiler session is running in this process (torch has one per
    process; a second profiler must not start or stop it)."""
    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    if enabled is None:
        raise RuntimeError(
            f"This torch ({torch.__version__}) has no `torch.autograd._profiler_enabled`, which "
            f"ProfilerSchedule reads to stand down beside another profiler. Please report the "
            f"version."
        )
    return bool(enabled())


def has_compiled_parts(model: Any) -> bool:
    """Whether ``model`` holds modules that ``torch.compile`` compiles at their first call:
    compiled in place (``nn.Module.compile``, the kit's RegionalCompile) or wrapped
    (``torch.compile(module)``, an ``OptimizedModule``)."""
    optimized = getattr(torch._dynamo.eval_frame, "OptimizedModule", ())
    return any(
        getattr(module, "_compiled_call_impl", None) is not None or isinstance(module, optimized)
        for module in model.modules()
    )
