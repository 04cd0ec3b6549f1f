"""cache_frozen_features without a Trainer: what is served, what runs, what is refused."""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

from lightning_speedkit.compute import _frozen_call
from lightning_speedkit.compute._frozen_core import FrozenFeatures, cache_frozen_features
from lightning_speedkit.compute._frozen_modules import ModuleWeights, fingerprint, plain_attributes
from lightning_speedkit.errors import SpeedkitConfigError


class _Tower(nn.Module):
    """A frozen encoder that counts the rows it ran on."""

    def __init__(self, out: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(3, out)
        self.rows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return torch.tanh(self.proj(x))


class _Model(nn.Module):
    def __init__(self, tower: nn.Module | None = None) -> None:
        super().__init__()
        self.tower = (tower or _Tower()).requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tower(x))


def _data(n: int = 8) -> torch.Tensor:
    return torch.randn(n, 3, generator=torch.Generator().manual_seed(0))


def test_hits_skip_the_module_and_partial_batches_run_only_their_misses() -> None:
    model, x = _Model(), _data()
    tower = model.tower
    cache = cache_frozen_features(model, ["tower"], verify=False)
    with cache.keys(range(4)):
        first = tower(x[:4])
    with cache.keys([2, 3, 4, 5]):  # two stored, two new
        mixed = tower(x[2:6])
    with cache.keys([5, 4, 3, 2]):
        served = tower(x[[5, 4, 3, 2]])
    assert tower.rows == [4, 2]
    new = torch.tanh(tower.proj(x[4:6]))  # the misses, run as the cache ran them
    assert torch.equal(first, torch.tanh(tower.proj(x[:4])))
    assert torch.equal(mixed, torch.cat([first[2:4], new]))
    assert torch.equal(served, torch.cat([new.flip(0), first[2:4].flip(0)]))
    counts = cache.counts()
    assert (counts["hits"], counts["misses"], counts["stored"]) == (6, 6, 6)
    assert counts["store_bytes"] == 6 * 4 * 4


def test_without_keys_the_module_runs_as_it_is() -> None:
    model, x = _Model(), _data()
    cache = cache_frozen_features(model, ["tower"], verify=False)
    with cache.keys(range(8)):
        model(x)
    model(x)  # validation, inference
    assert model.tower.rows == [8, 8]
    assert cache.counts()["hits"] == 0


def test_changed_weights_are_misses_never_stale_features() -> None:
    model, x = _Model(), _data()
    cache = cache_frozen_features(model, ["tower"], verify=False)
    with cache.keys(range(8)):
        model(x)
    with torch.no_grad():
        model.tower.proj.bias.add_(1.0)
    with cache.keys(range(8)):
        changed = model(x)
    assert model.tower.rows == [8, 8]
    assert torch.equal(changed, model.head(torch.tanh(model.tower.proj(x))))
    state = {k: v.clone() for k, v in model.tower.state_dict().items()}
    state["proj.bias"] -= 1.0
    model.tower.load_state_dict(state)  # back to the first weights: a new fingerprint again
    with cache.keys(range(8)):
        model(x)
    assert model.tower.rows == [8, 8, 8]
    assert cache.counts()["store_bytes"] == 8 * 4 * 4  # features of old weights dropped


def test_a_tower_unfrozen_after_storing_runs_again_and_says_why() -> None:
    model, x = _Model(), _data()
    cache = cache_frozen_features(model, ["tower"], verify=False)
    with cache.keys(range(8)):
        model(x)  # stored
    model.tower.proj.weight.requires_grad_(True)  # unfrozen mid-run: a served row would cut it
    with (
        pytest.warns(UserWarning, match="a parameter of `tower` requires grad now"),
        cache.keys(range(8)),
    ):
        out = model(x)
    assert model.tower.rows == [8, 8]
    assert out.requires_grad
    assert cache.counts()["hits"] == 0
    model.tower.proj.weight.requires_grad_(False)  # frozen again, same weights: served
    with cache.keys(range(8)):
        model(x)
    assert model.tower.rows == [8, 8]
    assert cache.counts()["hits"] == 8


def test_fingerprint_is_stable_and_sees_every_byte() -> None:
    torch.manual_seed(0)
    a = nn.Linear(3, 4)
    torch.manual_seed(0)
    b = nn.Linear(3, 4)
    assert fingerprint(a) == fingerprint(b)
    with torch.no_grad():
        b.weight[0, 0] = torch.nextafter(b.weight[0, 0], torch.tensor(1.0))
    assert fingerprint(a) != fingerprint(b)


def test_fingerprint_leaves_the_weights_storage_resizable() -> None:
    """FSDP frees its gathered weights after backward by resizing their storage to 0:
    hashing them must not pin it (``numpy()`` of the storage itself would)."""
    layer = nn.Linear(3, 4)
    fingerprint(layer)
    layer.weight.untyped_storage().resize_(0)  # raises if the storage was pinned


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A gloo process group of one rank in this process (an in-memory store, no port)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    gc.collect()  # the FSDP model's cycles hold the group: finalize it here


def _fsdp(model: nn.Module) -> nn.Module:
    """FSDP1 as the ``fsdp_zero2`` preset sets it (``use_orig_params=True``), one flat
    parameter holding the frozen tower and the trainable head (NO_SHARD on one rank)."""
    return FullyShardedDataParallel(
        model, use_orig_params=True, sharding_strategy=ShardingStrategy.NO_SHARD,
        device_id=torch.device("cpu"),
    )  # fmt: skip


@pytest.mark.usefixtures("one_rank")
def test_a_tower_wrapped_by_fsdp_or_a_checkpoint_wrapper_keeps_its_fingerprint() -> None:
    """FSDP1 keeps `rank` and `world_size` on its wrapper: in the key, each rank had its own
    and a shared `directory` served no rank another's features (a ViT tower's blocks are
    what `fsdp_zero2` wraps). The wrapped weights are named as if unwrapped too."""
    tower = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4))
    tower[1].temperature = 0.5
    plain = (plain_attributes(tower), fingerprint(tower))
    for wrap in (_fsdp, checkpoint_wrapper):
        wrapped = copy.deepcopy(tower)
        wrapped[0] = wrap(wrapped[0])
        assert (plain_attributes(wrapped), fingerprint(wrapped)) == plain, wrap


@pytest.mark.usefixtures("one_rank")
def test_under_fsdp_the_checks_ask_the_tower_own_parameters_not_its_views() -> None:
    """In forward, FSDP1 lends the tower fresh views of a flat parameter that requires
    grad (the head's is in it): ModuleWeights answers for the frozen parameters they stand
    for, with a stamp that stays while only the views are made again."""
    model = _Model()
    weights = ModuleWeights(model.tower)
    wrapped = _fsdp(model)
    seen: list[tuple[object, list[str], list[tuple[type, bool]]]] = []

    def look(module: nn.Module, args: object) -> None:
        stamp = weights.stamp()
        held = [(type(t), t.requires_grad) for t in module.parameters()]
        seen.append((stamp, weights.trainable(stamp), held))

    model.tower.register_forward_pre_hook(look)
    x = _data()
    for _ in range(2):
        wrapped(x).sum().backward()
    (first, trainable, held), (second, _, held_again) = seen
    assert held == held_again == [(torch.Tensor, True)] * 2  # views, requiring grad
    assert trainable == []
    assert first == second  # the views were made again; the stamp stayed
    with torch.no_grad():
        model.tower.proj.bias.add_(1.0)  # outside forward: the tower's own parameter
    wrapped(x)
    assert seen[-1][0] != first  # written to: fingerprint again
    model.tower.proj.weight.requires_grad_(True)  # unfrozen
    wrapped(x)
    assert seen[-1][1] == ["proj.weight"]


def _fsdp_step(
    run: nn.Module, model: _Model, x: torch.Tensor, cache: FrozenFeatures | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One training step's output and the head's gradients."""
    with cache.keys(range(len(x))) if cache is not None else contextlib.nullcontext():
        out = run(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.head.parameters() if p.grad is not None]
    run.zero_grad()
    return out.detach(), grads


@pytest.mark.usefixtures("one_rank")
def test_under_fsdp_a_frozen_tower_is_served_and_the_head_gradients_stay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cache under FSDP1 serves the tower (one fingerprint, not one per call), the
    outputs and the head's gradients are bit for bit those of the plain run, and a tower
    unfrozen mid-run runs again and says why."""
    x = _data()
    plain, cached = _Model(), _Model()
    cached.load_state_dict(plain.state_dict())
    cache = cache_frozen_features(cached, ["tower"], verify=False)
    hashed: list[nn.Module] = []
    monkeypatch.setattr(_frozen_call, "fingerprint", lambda m: hashed.append(m) or fingerprint(m))
    runs = _fsdp(plain), _fsdp(cached)
    for epoch in range(3):
        expected, head_grads = _fsdp_step(runs[0], plain, x)
        out, grads = _fsdp_step(runs[1], cached, x, cache)
        assert torch.equal(out, expected), epoch
        assert len(grads) == len(head_grads) == 2
        assert all(torch.equal(a, b) for a, b in zip(grads, head_grads, strict=True)), epoch
    assert cached.tower.rows == [8]  # epochs 1 and 2 served
    assert cache.counts()["hits"] == 16
    assert hashed == [cached.tower]
    cached.tower.proj.weight.requires_grad_(True)
    with pytest.warns(UserWarning, match=r"`tower` requires grad now \(proj.weight\)"):
        _fsdp_step(runs[1], cached, x, cache)
    assert cached.tower.rows == [8, 8]
    assert cache.counts()["hits"] == 16


def test_verify_stands_down_on_a_random_augmentation_and_names_it() -> None:
    model, x = _Model(), _data()
    cache = cache_frozen_features(model, ["tower"])
    with cache.keys(range(8)):
        model(x)
    flipped = -x  # the same samples, augmented differently this epoch
    with pytest.warns(UserWarning, match="random augmentation of its input"), cache.keys(range(8)):
        out = model(flipped)
    assert torch.equal(out, model.head(torch.tanh(model.tower.proj(flipped))))
    with cache.keys(range(8)):
        model(x)
    assert model.tower.rows == [8, 8, 8]  # stood down: runs every time
    counts = cache.counts()
    assert counts["store_bytes"] == 0
    assert list(counts["stood_down"]) == ["tower"]


def test_verify_passes_and_serves_after_one_recompute() -> None:
    model, x = _Model(), _data()
    cache = cache_frozen_features(model, ["tower"])
    for _ in range(3):
        with cache.keys(range(8)):
            model(x)
    assert model.tower.rows == [8, 8]
    assert cache.cached["tower"].counts.verified


@pytest.mark.parametrize(
    ("tower", "match"),
    [
        (nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.1)), r"`tower.1` is a Dropout with p=0.1"),
        (nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), r"`tower.1` is a BatchNorm1d in train"),
    ],
)
def test_chance_layers_in_train_mode_run_as_they_are_until_put_in_eval(
    tower: nn.Module, match: str
) -> None:
    """Named in train mode (as a freshly built tower is): not refused, run as it is and
    said once, and served once the model puts it in eval mode (a linear probe's
    ``on_train_epoch_start``). Refused at construction, that recipe could not work."""
    model = _Model(tower)
    cache = cache_frozen_features(model, ["tower"], verify=False)

    def step() -> None:
        with cache.keys(range(8)):
            model(_data())

    with pytest.warns(UserWarning, match=r"runs `tower` without the store: " + match):
        step()
    step()  # said once
    assert (cache.counts()["plain_calls"], cache.counts()["stored"]) == (2, 0)
    model.tower.eval()
    for _ in range(2):
        with cache.keys(range(8)):
            model(_data())
    assert (cache.counts()["misses"], cache.counts()["hits"]) == (8, 8)
    model.train()  # as Lightning does at fit start: served no more
    with cache.keys(range(8)):
        model(_data())
    assert cache.counts()["plain_calls"] == 3


def test_a_trainable_module_is_refused_with_its_parameters() -> None:
    model = _Model()
    model.tower.proj.requires_grad_(True)
    with pytest.raises(
        SpeedkitConfigError, match=r"parameters that require grad \(proj.weight, proj.bias\)"
    ):
        cache_frozen_features(model, ["tower"])


def test_a_module_name_or_type_that_matches_nothing_is_refused() -> None:
    with pytest.raises(SpeedkitConfigError, match=r"did you mean 'tower'"):
        cache_frozen_features(_Model(), ["towr"])
    with pytest.raises(SpeedkitConfigError, match=r"matches no submodule"):
        cache_frozen_features(_Model(), [nn.Conv2d])
    assert list(cache_frozen_features(_Model(), [_Tower]).modules) == ["tower"]


def test_calls_that_cannot_be_served_run_plainly() -> None:
    model, x = _Model(), _data()
    cache = cache_frozen_features(model, ["tower"], verify=False)
    with pytest.warns(UserWarning, match="has no row per sample"), cache.keys(range(5)):
        model(x)  # 8 rows, 5 keys: a collate step dropped samples the keys do not know of
    with pytest.warns(UserWarning, match="requires grad"), cache.keys(range(8)):
        model(x.requires_grad_(True))
    assert cache.counts()["plain_calls"] == 2
    assert cache.counts()["stored"] == 0


def test_a_module_called_twice_in_a_step_serves_each_call_its_own_features() -> None:
    model, x = _Model(), _data()
    expected = model.tower(x), model.tower(-x)
    cache = cache_frozen_features(model, ["tower"], verify=False)
    for _ in range(2):  # the first step stores both calls' features, the second serves them
        with cache.keys(range(8)):
            served = model.tower(x), model.tower(-x)  # inputs made in the model: by order
        assert all(torch.equal(a, b) for a, b in zip(served, expected, strict=True))
    counts = cache.counts()
    assert (counts["misses"], counts["stored"], counts["hits"]) == (16, 16, 16)
    assert counts["stood_down"] == {}
    assert sorted(cache.cached["tower"].slots) == [("call", 0), ("call", 1)]


def test_bfloat16_store_halves_the_bytes_and_rounds_the_features() -> None:
    model, x = _Model(), _data()
    cache = cache_frozen_features(model, ["tower"], dtype=torch.bfloat16, verify=False)
    with cache.keys(range(8)):
        model.tower(x)
    with cache.keys(range(8)):
        served = model.tower(x)
    exact = torch.tanh(model.tower.proj(x))
    assert served.dtype == torch.float32
    assert torch.equal(served, exact.to(torch.bfloat16).float())
    assert cache.counts()["store_bytes"] == 8 * 4 * 2


def test_budget_in_bytes_stops_storing() -> None:
    model, x = _Model(), _data()
    cache = cache_frozen_features(model, ["tower"], budget=3 * 16, verify=False)
    for _ in range(2):
        with cache.keys(range(8)):
            model(x)
    assert model.tower.rows == [8, 5]
    counts = cache.counts()
    assert (counts["stored"], counts["not_stored"], counts["hits"]) == (3, 10, 3)


def test_outputs_with_structure_are_served_whole() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(3, 2)

        def forward(
            self, x: torch.Tensor, scale: float = 1.0
        ) -> dict[str, tuple[torch.Tensor, ...]]:
            y = self.proj(x) * scale
            return {"states": (y, y.sum(-1))}

    model = nn.Sequential(Pair().requires_grad_(False))
    cache = cache_frozen_features(model, ["0"], verify=False)
    x = _data()
    with cache.keys(range(8)):
        first = model[0](x, scale=2.0)
    with cache.keys(range(8)):
        again = model[0](x, scale=2.0)
    assert torch.equal(again["states"][0], first["states"][0])
    assert torch.equal(again["states"][1], first["states"][1])
    assert cache.counts()["hits"] == 8
    with cache.keys(range(8)):  # another argument: another entry, never the first one's
        third = model[0](x, scale=3.0)
    assert torch.equal(third["states"][0], model[0].proj(x) * 3.0)


def test_auto_finds_the_frozen_module_called_with_a_batch_tensor() -> None:
    model, x = _Model(), _data()
    cache = cache_frozen_features(model)
    batch = {"x": x}
    with cache.keys(range(8), batch):
        model(batch["x"])
    assert list(cache.modules) == ["tower"]
    assert cache.counts()["stored"] == 8  # the step that found it stores what it ran
    with cache.keys(range(8), batch):
        model(batch["x"])
    assert model.tower.rows == [8, 8]  # found and stored, verified
    assert cache.counts()["hits"] == 0
    with cache.keys(range(8), batch):
        model(batch["x"])
    assert model.tower.rows == [8, 8]
    assert cache.counts()["hits"] == 8


def test_auto_stores_the_finding_step_so_no_sample_runs_later_in_a_few_rows() -> None:
    """The samples of the step that found the module were never stored: the next epoch ran
    them as one to three misses beside served rows, and a convolution's kernels compute a
    few rows' last bits otherwise than a batch's (a linear probe's losses differed)."""
    model, x = _Model(), _data()
    cache = cache_frozen_features(model, verify=False)
    epochs = [[0, 1, 2, 3], [4, 5, 6, 7]], [[4, 0, 5, 6], [1, 2, 7, 3]]  # shuffled
    for epoch in epochs:
        for keys in epoch:
            batch = {"x": x[keys]}
            with cache.keys(keys, batch):
                model(batch["x"])
    assert model.tower.rows == [4, 4]  # epoch 1 whole; epoch 2 all served, no partial batch
    assert cache.counts()["hits"] == 8


def test_a_key_twice_in_a_batch_is_stored_once() -> None:
    model, x = _Model(), _data()
    cache = cache_frozen_features(model, ["tower"], verify=False)
    keys = [3, 1, 3, 2]  # a sampler that draws with replacement
    with cache.keys(keys):
        model(x[keys])
    counts = cache.counts()
    assert (counts["misses"], counts["stored"], counts["store_bytes"]) == (4, 3, 3 * 4 * 4)


def test_auto_that_finds_nothing_says_how_to_name_the_module() -> None:
    model, x = _Model(), _data()
    cache = cache_frozen_features(model)
    with (
        pytest.warns(UserWarning, match=r"found no frozen submodule.*modules=\['<name>'\]"),
        cache.keys(range(8), {"x": x}),
    ):
        model(x * 2)  # the tower's input is computed from the batch
    assert cache.modules == {}


def test_remove_puts_the_forward_back() -> None:
    model = _Model()
    cache = cache_frozen_features(model, ["tower"])
    assert "forward" in vars(model.tower)
    cache.remove()
    assert "forward" not in vars(model.tower)


class _Pooling(nn.Module):
    """A tower whose output's layout depends on a keyword: a tensor, or a tuple of two."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2).requires_grad_(False)

    def forward(self, x: torch.Tensor, pool: bool = True) -> Any:
        y = self.linear(x)
        return y if pool else (y, y * 2)


def test_calls_on_one_field_with_other_arguments_keep_their_own_layouts() -> None:
    """Both calls read the same batch field; the second asks for the tuple. Served from one
    slot, the tuple call came back as the first call's tensor."""
    tower, x = _Pooling(), _data()
    expected = tower(x), tower(x, pool=False)
    model = nn.Module()
    model.tower = tower
    cache = cache_frozen_features(model, ["tower"], verify=True)
    batch = {"x": x}
    for _ in range(3):  # store, check each, serve
        with cache.keys(range(8), batch):
            pooled, pair = tower(batch["x"]), tower(batch["x"], pool=False)
        assert torch.equal(pooled, expected[0])
        assert isinstance(pair, tuple)
        assert all(torch.equal(a, b) for a, b in zip(pair, expected[1], strict=True))
    (slot,) = cache.cached["tower"].slots.values()  # one field: one slot, two layouts
    assert len(slot.layouts) == 2
    assert cache.counts()["hits"] == 8 + 16  # the second step checked the first call only
