"""Which submodules the frozen-feature cache may serve, and a fingerprint of their weights.

A module's outputs can be stored per sample and served later only when they depend on
nothing but the sample and the weights: every parameter frozen (no gradient flows into
it), and no layer whose output in train mode depends on chance (dropout with ``p > 0``)
or on the rest of the batch (BatchNorm in train mode, which normalises by the batch's
statistics and updates its running ones). :func:`why_not_cacheable` says which rule a
module breaks, in words a user can act on; :func:`fingerprint` is a stable hash of the
weights and plain attributes, so that features computed with other weights (or another
``temperature``) are never served, and
:class:`ModuleWeights` the per-call checks (trainable? written to?) that ask the module's
own parameters, also where FSDP lends it views of a flat parameter for the forward.
:class:`RandomDraws` sees a forward that draws random numbers with no layer to show it
(a sampled posterior, added noise), on its first call.
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_speedkit import _compat, _validation

__all__ = [
    "ModuleWeights",
    "RandomDraws",
    "Stamp",
    "attributes_changed",
    "check_modules",
    "choose_modules",
    "drawn_input",
    "fingerprint",
    "frozen_candidates",
    "mismatch",
    "plain_attributes",
    "random_draws",
    "why_not_cacheable",
]

#: Layers whose train-mode output is random (dropout) or depends on the batch (BatchNorm).
_DROPOUT = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)
_BATCH_NORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
#: Attributes that hold the rate of a dropout a layer calls as a function in train mode
#: (Hugging Face attention's ``self.dropout = config.attention_dropout``, stochastic depth).
_RATES = ("dropout", "attention_dropout", "attn_dropout", "dropout_p", "drop_prob")


def _rate(layer: nn.Module) -> tuple[str, float] | None:
    """The name and value of a positive dropout rate ``layer`` keeps as a number, or None."""
    for name in _RATES:
        value = vars(layer).get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return name, float(value)
    return None


def why_not_cacheable(name: str, module: nn.Module) -> str | None:
    """Why ``module``'s outputs cannot be served from a store (a parameter that requires
    grad); None if they can. Its layers' modes are checked at each call instead
    (:func:`why_not_now`): Lightning puts the model in train mode at fit start, and a
    tower put back in eval mode in ``on_train_epoch_start`` is served from then on.

    Example::

        >>> print(why_not_cacheable("head", nn.Linear(2, 2)))
        `head` has parameters that require grad (weight, bias): a stored output would cut their gradient; freeze them with `module.requires_grad_(False)`
        >>> why_not_cacheable("tower", nn.Linear(2, 2).requires_grad_(False)) is None
        True
    """  # noqa: E501
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    if trainable:
        shown = ", ".join(trainable[:3]) + (", ..." if len(trainable) > 3 else "")
        return (
            f"`{name}` has parameters that require grad ({shown}): a stored output would cut "
            f"their gradient; freeze them with `module.requires_grad_(False)`"
        )
    return None


def _chance_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers of ``module`` whose output in train mode is random or batch-dependent."""
    found: list[tuple[str, nn.Module]] = []
    for sub_name, sub in module.named_modules():
        chance = isinstance(sub, _DROPOUT) and sub.p > 0
        if isinstance(sub, _BATCH_NORM) or chance or _rate(sub) is not None:
            found.append((sub_name, sub))
    return found


def why_not_now(
    name: str, module: nn.Module, chance: Sequence[tuple[str, nn.Module]]
) -> str | None:
    """Why ``module`` cannot be served in the mode it is in now (one of ``chance`` trains)."""
    for sub_name, sub in chance:
        if not sub.training:
            continue
        where = f"`{name}.{sub_name}`" if sub_name else f"`{name}`"
        if isinstance(sub, _BATCH_NORM):
            what = (
                f"{where} is a {type(sub).__name__} in train mode: it normalises by each "
                f"batch's statistics and updates its running ones"
            )
        elif isinstance(sub, _DROPOUT):
            what = f"{where} is a {type(sub).__name__} with p={sub.p} in train mode: random output"
        else:
            rate, value = _rate(sub) or ("dropout", 0.0)
            kind = type(sub).__name__
            what = f"{where} is a {kind} with {rate}={value} in train mode: random output"
        return (
            f"{what}, so `{name}`'s output is not a function of the sample; put it in eval mode "
            f"(`{name}.eval()` in `on_train_epoch_start`, after Lightning's `model.train()`) "
            f"or leave `{name}` out of `modules`"
        )
    return None


class RandomDraws:
    """The random generators a call of ``module`` may draw from, as they stand before it:
    torch's CPU generator, the CUDA generator of each CUDA device its tensors or weights
    are on, and each ``torch.Generator`` passed to it or held by one of its layers. After
    the call, :meth:`why` says whether it drew from one.

    The cache takes it on a module's first call only (each kind of call's, see
    ``Slot``). Reading a generator's state draws nothing and waits for no device (a CUDA
    generator keeps its seed and offset on the host). Not seen: Python's ``random``,
    NumPy's, other accelerators' generators, and a ``torch.Generator`` the forward reaches
    otherwise (a module-level global, a field of a config object).

    Example::

        >>> tower = nn.Linear(2, 2)
        >>> draws = RandomDraws(tower, (torch.zeros(1, 2),), {})
        >>> _ = tower(torch.zeros(1, 2))
        >>> draws.why() is None
        True
        >>> _ = tower(torch.zeros(1, 2)) + 1e-6 * torch.randn(1, 2)  # a sampled posterior
        >>> print(draws.why()[:72])
        its forward draws random numbers (from torch's CPU generator): a sampled
    """

    def __init__(self, module: nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        values = {**{f"{i}": v for i, v in enumerate(args)}, **kwargs}
        read: dict[str, Any] = {"torch's CPU generator": torch.get_rng_state}
        tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
        cuda = {t.device for t in [*tensors, *module.parameters()] if t.device.type == "cuda"}
        for device in cuda if cuda and not torch.cuda.is_current_stream_capturing() else ():
            read[f"the CUDA generator of {device}"] = lambda d=device: torch.cuda.get_rng_state(d)
        held = [(f"the generator `{p}.{n}`" if p else f"the generator `{n}`", g)
                for p, sub in module.named_modules()
                for n, g in vars(sub).items() if isinstance(g, torch.Generator)]  # fmt: skip
        given = [(f"the generator passed as `{n}`", g) for n, g in values.items()
                 if isinstance(g, torch.Generator)]  # fmt: skip
        for label, generator in held + given:
            read[label] = generator.get_state
        self._before = [(label, fn, fn()) for label, fn in read.items()]

    def why(self) -> str | None:
        """Why the module's output cannot be served, if the call drew random numbers."""
        moved = [label for label, fn, before in self._before if not torch.equal(fn(), before)]
        if not moved:
            return None
        return (
            f"its forward draws random numbers (from {', '.join(moved)}): a sampled "
            f"posterior (`latent_dist.sample()`), added noise, or a dropout applied as a "
            f"function in train mode. Its output is not a function of the sample, and a "
            f"served call would draw nothing, so every later draw of the step (noise, "
            f"timesteps) would differ from the plain run's. Cache the deterministic part "
            f"instead and sample after it: the module that computes the distribution's "
            f"parameters (a diffusers VAE: `modules=['vae.encoder']`, as `'auto'` finds it), "
            f"or return `latent_dist.mode()`"
        )


def random_draws(
    name: str, module: nn.Module, args: Sequence[Any], kwargs: dict[str, Any]
) -> RandomDraws | None:
    """A :class:`RandomDraws` for a call of ``module``, or None when one of its layers in
    train mode shows its randomness already (:func:`why_not_now` says it at each call)."""
    if why_not_now(name, module, _chance_layers(module)) is not None:
        return None
    return RandomDraws(module, args, kwargs)


def drawn_input(field: Any) -> str:
    """Why a module whose input ``field`` two reads of a dataset's sample disagreed on
    (see :func:`~._frozen_loader.dataset_fingerprint`) is not served."""
    return (
        f"its input, the batch's `{field}`, differed between two reads of one sample of the "
        f"dataset (a random augmentation, random crops or flips, noise drawn in the dataset): "
        f"a stored feature would serve one draw in every epoch. Augment after the frozen "
        f"module (on its features), or only with a fixed per-sample transform, or remove "
        f"FrozenFeatureCache"
    )


def frozen_candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Submodules (the model itself left out) with parameters, all of them frozen."""
    found = []
    for name, module in model.named_modules():
        params = list(module.parameters())
        if name and params and not any(p.requires_grad for p in params):
            found.append((name, module))
    return found


def topmost(names: Iterable[str]) -> list[str]:
    """``names`` without those inside another of them (``vision.patch`` inside ``vision``)."""
    chosen = sorted(set(names))
    return [n for n in chosen if not any(n.startswith(o + ".") for o in chosen if o != n)]


def check_modules(modules: Any) -> list[Any]:
    """``modules`` as a list of names and module types (``[]`` for ``"auto"``), refused
    with the fix when it is none of those: judged before any model is seen."""
    if modules == "auto":
        return []
    given = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    if not given:
        _validation.fail(
            "modules",
            modules,
            "names no module",
            "pass `modules='auto'`, a submodule's name or a module type",
        )
    for item in given:
        if not isinstance(item, str) and not (
            isinstance(item, type) and issubclass(item, nn.Module)
        ):
            _validation.fail(
                "modules",
                item,
                "must be 'auto', a submodule name or an nn.Module type",
                "pass e.g. `modules=['vision']` or `modules=[MyVisionTower]`",
            )
    return given


def choose_modules(model: nn.Module, modules: Any) -> list[tuple[str, nn.Module]]:
    """The submodules ``modules`` names: a name, a module type, or a list of either.

    Every name must exist and every type must match at least one submodule; a module
    inside another chosen one is left to its ancestor.
    """
    given = check_modules(modules)
    named = dict(model.named_modules())
    names: list[str] = []
    for item in given:
        if isinstance(item, str):
            if item not in named or not item:
                ends = [n for n in named if n and n.split(".")[-1] == item.split(".")[-1]]
                close = ends or difflib.get_close_matches(item, [n for n in named if n], n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                tops = ", ".join(repr(n) for n in named if n and "." not in n)
                fix = (
                    f"{hint}pass a name from `model.named_modules()`, e.g. one of {tops}"
                    if tops
                    else "the model has no submodules: cache a model that holds the frozen one"
                )
                _validation.fail("modules", item, "is not a submodule of the model", fix)
            names.append(item)
        else:  # a module type (check_modules refused anything else)
            matched = [n for n, m in named.items() if n and isinstance(m, item)]
            if not matched:
                _validation.fail(
                    "modules",
                    item,
                    "matches no submodule of the model",
                    "pass a type the model holds, or the submodule's name",
                )
            names.extend(matched)
    return [(n, named[n]) for n in topmost(names)]


#: The child a wrapper module holds the wrapped one under: FSDP1's, a checkpoint wrapper's,
#: torch.compile's ``OptimizedModule``'s.
_WRAPPED = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def _unwrapped(name: str) -> str:
    """``name`` without the wrappers' parts: the same module is named alike wrapped or not."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPED)


def _weights(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(_unwrapped(name), tensor)
            for name, tensor in (*module.named_parameters(), *module.named_buffers())]  # fmt: skip


#: A weight's stamp: its tensor's identity, its version counter, and whether it requires grad.
Stamp = tuple[tuple[int, int, bool], ...]


class ModuleWeights:
    """``module``'s parameters as its owner registered them (and its buffers), seen
    through FSDP's forward-time views, for the cheap checks made on every call.

    FSDP1 with ``use_orig_params=True`` (the ``fsdp_zero2`` preset) puts, for the length
    of each forward, plain tensors in place of the module's parameters: views of a flat
    parameter, made again every forward, that require grad as soon as one parameter
    flattened with them does (a trainable head beside a frozen tower). Outside forward
    the module holds its own ``nn.Parameter`` objects again (FSDP keeps them, with their
    data a view of this rank's shard, and gives them a gradient only where they require
    one). Each walk remembers, per submodule and name, the ``nn.Parameter`` it finds, and
    lets a forward-time view answer for the parameter it stands for: then whether a weight
    is trainable is the owner's intent, and a stamp does not change when FSDP only made
    its views again. FSDP2 (``fsdp2_zero2``) registers ``nn.Parameter`` objects in forward
    too, the same ones every step, with the ``requires_grad`` of the sharded ones.

    Example::

        >>> tower = nn.Linear(2, 2).requires_grad_(False)
        >>> weights = ModuleWeights(tower)
        >>> stamp = weights.stamp()
        >>> weights.trainable(stamp), weights.stamp() == stamp
        ([], True)
        >>> _ = tower.bias.requires_grad_(True)
        >>> weights.trainable(weights.stamp())
        ['bias']
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._owned: dict[tuple[nn.Module, str], torch.Tensor] = {}
        self._names: list[str] = []
        self.stamp()  # made outside forward: every parameter is its owner's own
        self._attributes = plain_attributes(module)

    def registered(self) -> list[tuple[str, torch.Tensor]]:
        """Each parameter (the owner's, for a view that stands for one) and buffer, by name."""
        found: list[tuple[str, torch.Tensor]] = []
        for prefix, sub in self.module.named_modules():
            dot = f"{prefix}." if prefix else ""
            for name, tensor in sub.named_parameters(recurse=False):
                if isinstance(tensor, nn.Parameter):
                    self._owned[(sub, name)] = tensor
                else:  # FSDP1's view, in forward: the parameter it stands for
                    tensor = self._owned.get((sub, name), tensor)
                found.append((dot + name, tensor))
            found.extend((dot + name, buffer) for name, buffer in sub.named_buffers(recurse=False))
        return found

    def stamp(self) -> Stamp:
        """Which tensors hold the weights, how often each was written in place, and whether
        each requires grad: one walk of the weights per call serves both checks.

        Cheap (no device work, no sync): it changes when a weight is replaced or written to
        (an optimizer step, ``load_state_dict``, ``copy_``), which is when
        :func:`fingerprint` must be computed again. Under FSDP a rank writes only its own
        shard: a weight changed on another rank's shard alone does not change this rank's
        stamp (see :meth:`CachedModule.forward`, which fingerprints again after any call
        that found a weight trainable).
        """
        weights = self.registered()
        self._names = [name for name, _ in weights]
        return tuple((id(t), _compat.tensor_version(t), t.requires_grad) for _, t in weights)

    def trainable(self, stamp: Stamp) -> list[str]:
        """The names of the weights that require grad in ``stamp`` (this walk's)."""
        return [n for n, (_, _, grad) in zip(self._names, stamp, strict=True) if grad]

    def attributes_moved(self) -> list[str]:
        """The :func:`plain_attributes` changed, added or gone since the last call (or since
        this was made), by name: taken with each :func:`fingerprint`, to say which moved."""
        now = plain_attributes(self.module)
        before, self._attributes = self._attributes, now
        return sorted(n for n in before.keys() | now.keys() if before.get(n) != now.get(n))


def fingerprint(module: nn.Module) -> str:
    """A stable hash of ``module``'s parameters and buffers (names, dtypes, shapes, bytes)
    and of its :func:`plain_attributes` (a ``temperature`` its forward divides by).

    Equal weights and attributes give equal fingerprints in any process; any changed byte
    or attribute changes it.
    Reads every weight to the host: a sync on an accelerator, done only when
    :meth:`ModuleWeights.stamp` changed. It reads the tensors the module holds now: in
    an FSDP forward, the whole gathered weights (the same on every rank), not a shard.

    Example::

        >>> layer = nn.Linear(2, 2)
        >>> before = fingerprint(layer)
        >>> with torch.no_grad():
        ...     _ = layer.weight.add_(1)
        >>> fingerprint(layer) == before
        False
        >>> layer.temperature = 2.0  # a plain attribute, which a forward may read
        >>> before = fingerprint(layer)
        >>> layer.temperature = 3.0
        >>> fingerprint(layer) == before
        False
    """
    digest = hashlib.blake2b(digest_size=16)
    for name, text in sorted(plain_attributes(module).items()):
        digest.update(f"{name}={text};".encode())
    for name, tensor in _weights(module):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        # SYNC: copies the weight to the host (once per change of the weights).
        # A copy: numpy() of a tensor's own storage would pin that storage's size, and FSDP
        # frees its gathered weights' storage after backward by resizing it.
        data = tensor.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8)
        digest.update(data.numpy().tobytes())
    return digest.hexdigest()


#: Values a plain attribute holds to be part of a module's fingerprint, alone or in a
#: short tuple: what a forward reads as a setting (a temperature, a scale, a flag). A list
#: is left out: it is where a module collects what it saw (``self.rows.append(n)``).
_PLAIN = (bool, int, float, str, type(None), torch.dtype)


def plain_attributes(module: nn.Module) -> dict[str, str]:
    """``module``'s and its submodules' public plain attributes, by dotted name, as text.

    Plain: a number, a string, a bool, None or a dtype, or a tuple of up to 64 of those
    (``self.temperature = 0.07``, ``self.scale``, ``self.kernel_size``): settings a
    forward may read besides its weights and arguments. Left out: ``training`` (the
    modes are checked at each call, see :func:`why_not_now`), a name with a leading
    underscore (torch's bookkeeping), a list (what a module collects), an object (a
    config) and a tensor that is not a buffer; and a wrapper's own (FSDP1's ``rank``
    and ``world_size``, which would give each rank its own key), the module it wraps
    being named as if unwrapped. Reading them walks the modules' ``__dict__``: no
    device work.

    Example::

        >>> tower = nn.Sequential(nn.Linear(2, 2))
        >>> tower[0].temperature, tower[0]._calls = 0.5, 3
        >>> plain_attributes(tower)
        {'0.in_features': '2', '0.out_features': '2', '0.temperature': '0.5'}
    """
    found: dict[str, str] = {}
    for prefix, sub in module.named_modules():
        if any(child in _WRAPPED for child, _ in sub.named_children()):
            continue  # a wrapper's settings: FSDP's `rank` and `world_size` differ per rank
        dot = f"{_unwrapped(prefix)}." if prefix else ""
        for name, value in vars(sub).items():
            if not name.startswith("_") and name != "training" and _is_plain(value):
                found[dot + name] = repr(value)
    return found


def _is_plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return len(value) <= 64 and all(isinstance(v, _PLAIN) for v in value)
    return isinstance(value, _PLAIN)


def attributes_changed(name: str, changed: list[str]) -> str:
    """What a cache says when ``changed`` plain attributes of its module ``name`` (seen
    when its fingerprint is taken again) made its stored features go."""
    shown = ", ".join(f"`{a}`" for a in changed[:3]) + (", ..." if len(changed) > 3 else "")
    return (
        f"FrozenFeatureCache computes `{name}`'s features again: its attribute(s) {shown} "
        f"changed since they were stored, and a plain attribute, which its forward may read, "
        f"is part of a feature's key. One that changes every epoch leaves nothing to serve; "
        f"one the forward does not read can be kept out of the key by a leading underscore"
    )


def mismatch(largest: float, first: str = "") -> str:
    """Why a cached module's stored features differ from the ones computed again on their
    first reuse (``largest``: the largest difference): the likely causes, first the two
    most common (after ``first``, a cause that applies to this call), and the fixes."""
    return (
        f"on its first reuse, recomputed features differ from the stored ones (largest "
        f"difference {largest:.3g}): most likely {first}a random augmentation of its input (random "
        f"crops, flips, color jitter), or state its forward reads that a feature's key does "
        f"not hold (the key holds the weights and buffers, the call's arguments and the "
        f"public number and string attributes, read again as each epoch starts; not a list, "
        f"an object's field, a private attribute, a tensor that is not a buffer, nor a "
        f"change within the epoch: register such state as a buffer). Else randomness "
        f"inside it, its weights written through "
        f"`p.data` in this epoch (an EMA teacher: cache it only if it changes between "
        f"epochs), a collate_fn that reorders the samples (the rows must follow the "
        f"sampler's order), or a dataset changed in place with its first, middle and last "
        f"samples the same (a reload that picks another subset: key by a sample id, "
        f"`key='<field>'`). Augment before caching only with a fixed per-sample transform, "
        f"or remove FrozenFeatureCache"
    )
