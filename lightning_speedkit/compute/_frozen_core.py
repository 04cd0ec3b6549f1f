"""cache_frozen_features: a frozen submodule's outputs stored per sample, served again later.

The Trainer-free core of :class:`~lightning_speedkit.FrozenFeatureCache`. It puts a store in
front of each chosen module's ``forward`` (see ``_frozen_call``); the caller says which
samples the current batch holds, and the modules serve those already stored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lightning_speedkit import _compat, _validation
from lightning_speedkit.compute._frozen_call import CachedModule, ModuleCounts, Scope
from lightning_speedkit.compute._frozen_disk import DiskStore, prepare_directory
from lightning_speedkit.compute._frozen_layout import FieldLayout, batch_fields
from lightning_speedkit.compute._frozen_lease import PruneReport, prune_frozen_features
from lightning_speedkit.compute._frozen_loader import dataset_fingerprint
from lightning_speedkit.compute._frozen_modules import (
    RandomDraws,
    check_modules,
    choose_modules,
    frozen_candidates,
    random_draws,
    topmost,
    why_not_cacheable,
)
from lightning_speedkit.compute._frozen_rows import batch_field, same_tensor
from lightning_speedkit.compute._frozen_skip import LoaderPlan, SkipPlan
from lightning_speedkit.compute._frozen_store import FeatureStore, budget_bytes
from lightning_speedkit.measure.flops import model_flops_so_far

__all__ = ["FrozenFeatures", "cache_frozen_features", "check_dtype"]

_COUNTERS = ("hits", "misses", "stored", "not_stored", "plain_calls", "refetched")


class FrozenFeatures:
    """The cache :func:`cache_frozen_features` puts on a model (use that to make one).

    Attributes:
        modules: the cached submodules by name (empty until ``"auto"`` has found them).
        store: the features kept, in host memory within the budget, and with a
            ``directory`` on disk too (``store.disk``).
    """

    def __init__(self, model: nn.Module, modules: Any, store: FeatureStore, scope: Scope) -> None:
        self.model, self.store, self._scope = model, store, scope
        self._auto = modules == "auto"
        self.cached: dict[str, CachedModule] = {}
        self._found: set[str] = set()
        self._found_flops: dict[str, dict[Hashable, float]] = {}  # per row, by batch field
        self._drew: dict[str, str] = {}  # found modules whose forward drew random numbers
        self._watched = False  # the first step's calls have been watched
        self._probes: list[Any] = []
        #: The found modules' calls in the step ``"auto"`` watched: stored once chosen.
        self._first_calls: dict[str, list[tuple[Any, Any, Any]]] = {}
        self._loaded: dict[str, Any] = {}  # counters of modules "auto" has not found yet
        self._plan = LoaderPlan(scope)  # the loader's: which samples come without inputs
        self.skipped = 0  # rows that came with their cached inputs left out
        self._call_hook: Any = model.register_forward_pre_hook(self._note_call, with_kwargs=True)
        if not self._auto:
            for name, module in choose_modules(model, modules):
                why = why_not_cacheable(name, module)
                if why is not None:
                    _validation.fail("modules", name, "cannot be cached", why)
                self._add(name, module)

    @property
    def modules(self) -> dict[str, nn.Module]:
        return {name: cached.module for name, cached in self.cached.items()}

    def _add(self, name: str, module: nn.Module) -> None:
        if getattr(module, "_speedkit_frozen", None) is not None:
            _validation.fail(
                "modules",
                name,
                "is cached already by another FrozenFeatureCache",
                "call `.remove()` on that cache first, or keep only one",
            )
        cached = CachedModule(name, module, self._scope)
        cached.flops_hints = self._found_flops.pop(name, {})
        if name in self._loaded:
            cached.counts = ModuleCounts(**self._loaded.pop(name))
        cached.attach()
        self.cached[name] = cached

    # -- the step ------------------------------------------------------------------------------

    def use_loader(
        self, plan: SkipPlan | None, refetch: Callable[[Sequence[Hashable], Hashable], Any] | None
    ) -> None:
        """The loader's plan of which samples come without the cached modules' inputs
        (:mod:`._frozen_skip`), and what reads a left-out input again; None: no plan."""
        self._plan.use(plan)
        self._scope.refetch = refetch

    def start_step(
        self,
        keys: Sequence[Hashable],
        batch: Any = None,
        stand_ins: Sequence[int] = (),
        layouts: dict[Hashable, FieldLayout] | None = None,
    ) -> None:
        """The batch about to run holds the samples ``keys``: one per row of each cached
        module's input, in order (with a varying number of images per sample, one per
        image: see :mod:`._frozen_layout`).

        ``stand_ins`` are the rows whose cached inputs the loader left out (a module never
        runs on them: their real inputs are read again first); ``layouts`` how the loader's
        collate made each batch field from the samples, which the rows are checked against.
        With ``modules="auto"`` and nothing found yet, ``batch`` is watched: the frozen
        submodules called with one of its tensors are cached at :meth:`end_step`.
        """
        self._scope.keys = list(keys)
        self._scope.stand_ins = list(stand_ins)
        self._scope.fields = batch_fields(batch)
        self._scope.layouts, self._scope.seen = layouts, {}
        self.skipped += len(stand_ins)
        for cached in self.cached.values():
            cached.new_step()
        first = not self._watched and batch is not None  # named modules: is each called?
        if (first or (self._auto and not self.cached)) and not self._probes and batch is not None:
            self._watched = True
            self._watch(batch)

    def end_step(self) -> None:
        """The batch has run: calls without keys run the modules as they are."""
        keys = self._scope.keys
        if self._probes:  # with the step's keys and fields still set: found calls are stored
            for handle in self._probes:
                handle.remove()
            self._probes = []
            if self._auto and not self.cached:
                self._choose_found()
            else:
                self._warn_not_called()
        self._first_calls = {}
        self._scope.keys, self._scope.fields, self._scope.stand_ins = None, {}, ()
        self._scope.layouts, self._scope.seen = None, {}
        self._forget_lost()
        if keys:
            self._plan.update(list(self.cached.values()), keys)

    def _note_call(self, model: nn.Module, args: Any, kwargs: Any) -> None:
        """A step given no batch: the tensors the model is called with stand for it, to
        check the cached modules' rows against (:func:`~._frozen_layout.why_not_rows`)."""
        if self._scope.keys is not None and not self._scope.fields:
            seen = {**dict(enumerate(args)), **kwargs}
            self._scope.seen = {k: v for k, v in seen.items() if isinstance(v, torch.Tensor)}

    def _forget_lost(self) -> None:
        """Samples whose features were only in a disk shard that failed to write are no
        longer ready (the loader must bring their inputs again)."""
        lost = self.store.take_lost()
        for cached in self.cached.values():
            gone = {key[-1] for key in lost if key[0] == cached.name}
            if gone:
                cached.forget(gone)
                cached.drops += 1

    # -- the data and the disk -----------------------------------------------------------------

    def use_dataset(self, dataset: Any) -> None:
        """Key features by ``dataset`` too (its :func:`dataset_fingerprint`): with sample keys
        that are dataset indices, another dataset's index ``i`` is another sample. Features
        of the dataset used before leave the memory store."""
        drawn: set[Hashable] = set()
        data = dataset_fingerprint(dataset, drawn=drawn)
        self._scope.drawn = drawn
        if data == self._scope.data:
            return
        if self._scope.data:
            self.store.drop()
            if self.store.disk is not None:  # the shards stay, uncounted
                self.store.disk.release(lambda base: base[3] != data)
            for cached in self.cached.values():
                cached.forget()
                cached.drops += 1
        self._scope.data = data

    def recheck_weights(self) -> None:
        """Fingerprint every cached module's weights and plain attributes again at its
        next call (the callback does it as each epoch starts). Call it after writing their
        weights through ``p.data``, which the per-call check cannot see (other writes it
        sees), or after changing a plain attribute a forward reads (``temperature``)."""
        for cached in self.cached.values():
            cached.recheck_weights()

    def flush(self) -> None:
        """Write the features the disk store holds in its buffer (none without ``directory``)."""
        if self.store.disk is not None:
            self.store.disk.flush()
        self._forget_lost()

    def refresh(self) -> None:
        """Look for shards other processes (the other ranks) completed since the last look."""
        if self.store.disk is not None:
            self.store.disk.refresh()

    @contextlib.contextmanager
    def keys(self, batch_keys: Sequence[Hashable], batch: Any = None) -> Iterator[None]:
        """Run the modules for the samples ``batch_keys`` inside the block.

        Example::

            >>> tower = nn.Linear(3, 2).requires_grad_(False)
            >>> model = nn.Sequential(tower, nn.Linear(2, 1))
            >>> cache = cache_frozen_features(model, modules=["0"], verify=False)
            >>> x = torch.randn(4, 3)
            >>> with cache.keys([10, 11, 12, 13]):
            ...     first = model(x)
            >>> with cache.keys([12, 13, 10, 11]):  # the same samples, another order
            ...     again = model(x[[2, 3, 0, 1]])
            >>> torch.equal(again, first[[2, 3, 0, 1]]), cache.counts()["hits"]
            (True, 4)
        """
        self.start_step(batch_keys, batch)
        try:
            yield
        finally:
            self.end_step()

    def _watch(self, batch: Any) -> None:
        """Note the frozen submodules called with a tensor of ``batch`` in this step, and,
        under a FLOP count (SpeedMonitor's first step), what each such call costs a row."""
        tree_flatten, _ = _compat.tree_flatten_and_map()
        fields = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
        running: dict[str, tuple[Hashable, float | None, bool, RandomDraws | None]] = {}

        def before(name: str) -> Any:
            def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
                given = [*args, *kwargs.values()]
                if any(same_tensor(value, field) for value in given for field in fields):
                    self._found.add(name)
                    watch = self._auto and not self.cached  # a named module checks its call
                    draws = random_draws(name, module, args, kwargs) if watch else None
                    field = batch_field(self._scope.fields, given)
                    running[name] = (field, model_flops_so_far(), watch, draws)

            return hook

        def after(name: str) -> Any:
            def hook(module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
                source, start, watch, draws = running.pop(name, (None, None, False, None))
                if draws is not None and (why := draws.why()) is not None:
                    self._drew[name] = why
                if watch:  # as it is now: the step may write it later
                    _, tree_map = _compat.tree_flatten_and_map()
                    kept = tree_map(lambda t: t.detach().clone() if _is_tensor(t) else t, out)
                    self._first_calls.setdefault(name, []).append((args, kwargs, kept))
                end, rows = model_flops_so_far(), len(self._scope.keys or ())
                if source is not None and start is not None and end is not None and rows:
                    self._found_flops.setdefault(name, {})[source] = (end - start) / rows

            return hook

        for name, module in frozen_candidates(self.model):
            self._probes.append(module.register_forward_pre_hook(before(name), with_kwargs=True))
            self._probes.append(module.register_forward_hook(after(name), with_kwargs=True))

    def _choose_found(self) -> None:
        named = dict(self.model.named_modules())
        # A module that drew random numbers is left out; its submodules that drew none serve.
        drew = [n for n in topmost(self._found) if n in self._drew]
        for name in [*drew, *topmost(self._found - self._drew.keys())]:
            why = self._drew.get(name) or why_not_cacheable(name, named[name])
            if why is None:
                self._add(name, named[name])
                for args, kwargs, out in self._first_calls.get(name, []):  # ran uncached
                    self.cached[name].take(args, kwargs, out)
            else:
                self._scope.warn_once(f"FrozenFeatureCache leaves `{name}` out: {why}.")
        if not self.cached and not self._drew:
            self._scope.warn_once(
                "FrozenFeatureCache(modules='auto') found no frozen submodule called with a "
                "tensor of the batch as it is (a module whose input is computed from the batch "
                "is not found); name it (`modules=['<name>']`), or give a module type."
            )

    def _warn_not_called(self) -> None:
        """A module named to cache whose forward did not run in the first step: say which
        of its frozen submodules took the batch's tensors instead (diffusers' VAE runs
        ``vae.encoder`` from ``vae.encode(x)``, never ``vae(x)``)."""
        for name, cached in self.cached.items():
            inside = [f for f in topmost(self._found) if f.startswith(f"{name}.")]
            if cached.slots or cached.counts.plain_calls or not inside:
                continue  # called, or perhaps called on later steps only: nothing to say
            self._scope.warn_once(
                f"FrozenFeatureCache: `{name}`'s forward did not run in the first training step, "
                f"but {', '.join(f'`{f}`' for f in inside)} of it took the batch's tensors (a "
                f"model that calls a method of it, such as `vae.encode(x)`, runs its "
                f"submodules): nothing of `{name}` is served; name those, or pass "
                f"`modules='auto'`."
            )

    # -- the rest ------------------------------------------------------------------------------

    def counts(self) -> dict[str, Any]:
        """Samples served (``hits``), run (``misses``), stored and not stored (the budget),
        calls run without the store (``plain_calls``), and per module, why it stood down.

        ``disk_bytes`` is the shard data this cache serves from (its modules' current
        weights, its dataset); ``disk_other_bytes`` the rest of the ``directory``'s (earlier
        weights, other datasets, other jobs: :meth:`prune` removes what nobody uses).
        """
        per = {name: cached.counts for name, cached in self.cached.items()}
        totals: dict[str, Any] = {k: sum(getattr(c, k) for c in per.values()) for k in _COUNTERS}
        totals["store_bytes"] = self.store.bytes
        totals["disk_bytes"] = self.store.disk_bytes
        totals["disk_other_bytes"] = self.store.disk.other_bytes() if self.store.disk else 0
        totals["inputs_skipped"] = self.skipped
        totals["stood_down"] = {n: c.stood_down for n, c in per.items() if c.stood_down}
        return totals

    def state_dict(self) -> dict[str, Any]:
        """The counters by module (never the features)."""
        return {name: vars(cached.counts).copy() for name, cached in self.cached.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, counts in state.items():
            if name in self.cached:
                self.cached[name].counts = ModuleCounts(**counts)
            else:
                self._loaded[name] = dict(counts)

    def remove(self) -> None:
        """Put every cached module's own forward back (the store stays, for :meth:`attach`);
        buffered features are written to the disk store."""
        self.flush()
        if self.store.disk is not None:
            self.store.disk.close()
        for cached in self.cached.values():
            cached.detach()
        if self._call_hook is not None:
            self._call_hook.remove()
            self._call_hook = None

    def attach(self) -> None:
        """Put the store in front of the modules again after :meth:`remove`."""
        if self.store.disk is not None:
            self.store.disk.reopen()
        if self._call_hook is None:
            hook = self.model.register_forward_pre_hook(self._note_call, with_kwargs=True)
            self._call_hook = hook
        for cached in self.cached.values():
            if vars(cached.module).get("_speedkit_frozen") is not cached:
                cached.attach()

    def disk_groups(self) -> list[str]:
        """The ``directory``'s group folders this cache serves from (none without one)."""
        return self.store.disk.groups() if self.store.disk is not None else []

    def prune(
        self, older_than: float = 0.0, max_bytes: int | None = None, dry_run: bool = False
    ) -> PruneReport:
        """Remove the ``directory``'s features this cache does not serve from and no running
        process uses (see :func:`prune_frozen_features`): by default all of them.

        Example::

            >>> import tempfile
            >>> tower = nn.Linear(3, 2).requires_grad_(False)
            >>> model = nn.Sequential(tower, nn.Linear(2, 1))
            >>> cache = cache_frozen_features(model, ["0"], directory=tempfile.mkdtemp())
            >>> with cache.keys([0, 1]):
            ...     _ = model(torch.randn(2, 3))
            >>> cache.flush()  # writes the shard
            >>> with torch.no_grad():
            ...     _ = tower.bias.add_(1.0)  # other weights: another group
            >>> with cache.keys([0, 1]):
            ...     _ = model(torch.randn(2, 3))
            >>> cache.flush()
            >>> before = cache.counts()
            >>> before["disk_bytes"], before["disk_other_bytes"]
            (32, 32)
            >>> cache.prune().freed_bytes, cache.counts()["disk_other_bytes"]
            (32, 0)
        """
        if self.store.disk is None:
            _validation.fail(
                "directory", None, "is not set, so there is nothing on disk to prune",
                "pass `directory=` to keep features on disk",
            )  # fmt: skip
        return prune_frozen_features(
            self.store.disk.directory,
            older_than=older_than,
            max_bytes=max_bytes,
            keep=self.disk_groups(),
            dry_run=dry_run,
        )


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def check_dtype(dtype: Any) -> torch.dtype | None:
    """A store dtype: a floating ``torch.dtype``, or None (the output's)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        _validation.fail(
            "dtype",
            dtype,
            "must be a floating torch.dtype or None",
            "pass e.g. `dtype=torch.bfloat16`, or None to keep the output's",
        )
    return dtype


def cache_frozen_features(
    model: nn.Module,
    modules: Any = "auto",
    *,
    budget: int | str = "50%",
    dtype: torch.dtype | None = None,
    verify: bool = True,
    directory: Any = None,
    dataset: Any = None,
) -> FrozenFeatures:
    """Serve frozen submodules' outputs from a per-sample store instead of running them.

    While keys are set (``with cache.keys(batch_keys):``, one key per row of the cached
    modules' input, the same key for the same sample in every epoch: one per image where
    the batch concatenates each sample's images), each cached module serves the
    samples it has stored and runs only for the others, which it stores. Without keys
    (validation, inference) it runs as it is.

    Args:
        model: the model holding the frozen submodules.
        modules: ``"auto"`` (default): the frozen submodules called with a tensor of the
            first batch as it is (e.g. ``batch["images"]``), found on the first keyed
            batch (that batch runs without the store); or a submodule name, a module type,
            or a list of those. A chosen module with a parameter that requires grad, or
            with dropout (``p > 0``) or BatchNorm in train mode, is refused with the reason.
        budget: bytes of host memory the store may hold, or a share of the free host
            memory (``"50%"``, the default). Past it, nothing more is kept in memory:
            those samples run their module every time, or with a ``directory`` are served
            from disk.
        dtype: the dtype features are stored in; None (default) keeps the module's output
            dtype, which serves bit-for-bit what the module computed. ``torch.bfloat16``
            halves a float32 store but changes the numerics: served features are rounded.
        verify: on the first reuse, run the module anyway and compare with the stored
            features; on a mismatch (a random augmentation of the input, state the
            forward reads that the key does not hold, or keys that are not one per row)
            stop serving, with a warning.
            Costs one batch's forward, once.
        directory: a folder for a disk store (created if missing): every stored feature
            is also written there, in memory-mapped shards, and what passes the budget is
            served from there. A later cache (another process, a resumed fit) on the same
            weights and data starts warm from it; several processes (DDP ranks) may share
            one. Buffered rows are written every 64 MiB and by :meth:`~FrozenFeatures.flush`
            (and ``remove()``). Refused with the fix when it is a file or not writable.
        dataset: the dataset the keys index (a fingerprint of it keys the features):
            pass it when the keys are dataset indices, so that another dataset's features
            are never served; None when the keys identify samples by themselves.

    Returns:
        The cache: ``keys(...)`` to run a batch, ``counts()``, ``remove()``.

    Example::

        >>> tower = nn.Sequential(nn.Linear(8, 8), nn.GELU()).requires_grad_(False)
        >>> model = nn.Sequential(tower, nn.Linear(8, 2))
        >>> cache = cache_frozen_features(model, modules=["0"])
        >>> x = torch.randn(4, 8)
        >>> for epoch in range(3):
        ...     with cache.keys([0, 1, 2, 3]):
        ...         _ = model(x)
        >>> counts = cache.counts()
        >>> counts["misses"], counts["hits"]  # epoch 0 runs, epoch 1 verifies, epoch 2 serves
        (8, 4)
    """
    if not isinstance(model, nn.Module):
        _validation.fail("model", model, "must be a torch.nn.Module", "pass the model itself")
    verify = _validation.boolean("verify", verify)
    check_dtype(dtype)
    check_modules(modules)
    disk = DiskStore(prepare_directory(directory)) if directory is not None else None
    store = FeatureStore(budget_bytes(budget), disk)
    scope = Scope(store=store, dtype=dtype, verify=verify)
    cache = FrozenFeatures(model, modules, store, scope)
    if dataset is not None:
        cache.use_dataset(dataset)
    return cache
