from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_speedkit import SpeedDataModuleMixin, SpeedkitConfigError
from lightning_speedkit.data import LengthBucketBatchSampler


def _all_ranks(
    lengths: list[int], batch_size: int, replicas: int, **kw: object
) -> list[list[list[int]]]:
    return [
        list(LengthBucketBatchSampler(lengths, batch_size, num_replicas=replicas, rank=r, **kw))  # type: ignore[arg-type]
        for r in range(replicas)
    ]


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 200), min_size=1, max_size=300),
    batch_size=st.integers(1, 16),
    replicas=st.integers(1, 4),
    shuffle=st.booleans(),
    epoch=st.integers(0, 5),
)
def test_every_sample_exactly_once_per_epoch_across_ranks(
    lengths: list[int], batch_size: int, replicas: int, shuffle: bool, epoch: int
) -> None:
    n, pool = len(lengths), batch_size * 50
    batches = sum(-(-min(pool, n - start) // batch_size) for start in range(0, n, pool))
    if n < replicas or -(-batches // replicas) * replicas > n:
        # Impossible without repeating samples: equal batch counts need more batches than samples.
        with pytest.raises(SpeedkitConfigError, match="cannot give"):
            _all_ranks(lengths, batch_size, replicas, shuffle=shuffle)
        return
    samplers = [LengthBucketBatchSampler(lengths, batch_size, num_replicas=replicas, rank=r,
                                         shuffle=shuffle) for r in range(replicas)]  # fmt: skip
    for s in samplers:
        s.set_epoch(epoch)
    per_rank = [list(s) for s in samplers]
    flat = [i for rank in per_rank for batch in rank for i in batch]
    assert sorted(flat) == list(range(len(lengths)))  # exactly once
    assert len({len(rank) for rank in per_rank}) == 1  # same number of batches on every rank
    assert all(1 <= len(b) <= batch_size for rank in per_rank for b in rank)
    assert all(len(s) == len(per_rank[0]) for s in samplers)


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=8, max_size=200),
    batch_size=st.integers(1, 8),
    replicas=st.integers(1, 3),
)
def test_drop_last_gives_full_batches_and_no_repeats(
    lengths: list[int], batch_size: int, replicas: int
) -> None:
    per_rank = _all_ranks(lengths, batch_size, replicas, drop_last=True)
    flat = [i for rank in per_rank for batch in rank for i in batch]
    assert len(flat) == len(set(flat))
    assert all(len(b) == batch_size for rank in per_rank for b in rank)
    assert len({len(rank) for rank in per_rank}) == 1


def test_deterministic_per_epoch_and_different_across_epochs() -> None:
    lengths = [random.Random(0).randint(1, 100) for _ in range(500)]
    a = LengthBucketBatchSampler(lengths, 8, num_replicas=2, rank=0, seed=3)
    b = LengthBucketBatchSampler(lengths, 8, num_replicas=2, rank=0, seed=3)
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b)
    a.set_epoch(1)
    assert list(a) == list(b)


def _padding_waste(batches: list[list[int]], lengths: list[int]) -> float:
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    return 1 - sum(lengths) / padded


def test_bucketing_cuts_padding_waste() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(10, 45) for _ in range(2000)]  # like the example's captions
    bucketed = list(LengthBucketBatchSampler(lengths, 32, num_replicas=1, rank=0))
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(0)).tolist()
    random_batches = [order[i : i + 32] for i in range(0, len(order), 32)]
    assert _padding_waste(random_batches, lengths) > 0.25
    assert _padding_waste(bucketed, lengths) < 0.02


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"batch_size": 0}, "batch_size"), ({"rank": 3, "num_replicas": 2}, "rank"),
     ({"pool_batches": 0}, "pool_batches")],
)  # fmt: skip
def test_bad_arguments_are_refused(kwargs: dict[str, int], argument: str) -> None:
    args = {"batch_size": 4, **kwargs}
    with pytest.raises(SpeedkitConfigError, match=f"`{argument}`"):
        LengthBucketBatchSampler(list(range(20)), **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("rank", [0, 1])
def test_in_a_stateful_dataloader_a_mid_epoch_resume_serves_the_rest_of_the_epoch(
    rank: int,
) -> None:
    """Its batches depend only on the seed and the epoch: torchdata moves it past those
    already served, so the resumed epoch is exactly what the interrupted run had left."""
    pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata (test extra)")
    from torchdata.stateful_dataloader import StatefulDataLoader

    lengths = torch.randint(1, 50, (64,), generator=torch.Generator().manual_seed(0))

    def loader() -> Any:
        batches = LengthBucketBatchSampler(lengths, batch_size=4, num_replicas=2, rank=rank,
                                           shuffle=True, seed=5)  # fmt: skip
        batches.set_epoch(3)  # as Lightning does at the resumed epoch
        return StatefulDataLoader(range(64), batch_sampler=batches)

    epoch = [batch.tolist() for batch in loader()]
    interrupted = loader()
    served = iter(interrupted)
    first = [next(served).tolist() for _ in range(3)]
    resumed = loader()
    resumed.load_state_dict(interrupted.state_dict())
    assert first + [batch.tolist() for batch in resumed] == epoch
    assert len(epoch) == 8


def _fit_and_record_batches(epochs: int) -> dict[int, list[list[int]]]:
    """Fit a tiny model for ``epochs`` epochs on a bucketed loader and record its batches."""
    import lightning as L
    from torch.utils.data import DataLoader

    class Recorder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: dict[int, list[list[int]]] = {}

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.seen.setdefault(self.current_epoch, []).append(batch.tolist())
            return self.layer(batch.float().unsqueeze(1)).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    lengths = [i % 7 + 1 for i in range(40)]
    batches = LengthBucketBatchSampler(lengths, batch_size=4, shuffle=True, seed=0)
    model = Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(model, DataLoader(range(40), batch_sampler=batches))
    return model.seen


def test_under_a_trainer_every_epoch_gets_new_batches() -> None:
    """Lightning sets the epoch on ``batch_sampler.sampler``, never on the batch sampler."""
    seen = _fit_and_record_batches(epochs=3)
    assert sorted(seen) == [0, 1, 2]
    assert seen[0] != seen[1]
    assert seen[1] != seen[2]
    assert seen[0] != seen[2]
    for epoch, batches in seen.items():  # each epoch still every sample once, as set_epoch gives
        expected = LengthBucketBatchSampler([i % 7 + 1 for i in range(40)], 4, seed=0)
        expected.set_epoch(epoch)
        assert batches == list(expected)


def test_with_the_distributed_sampler_lightning_injects_every_epoch_gets_new_batches() -> None:
    """Under DDP Lightning rebuilds the batch sampler around a ``DistributedSampler`` and
    sets that sampler's epoch on every rank (what ``Trainer(strategy="ddp")`` does, in
    process: the same Lightning functions, without spawning ranks)."""
    from lightning.fabric.utilities.data import _replace_dunder_methods, _set_sampler_epoch
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

    lengths = [random.Random(0).randint(1, 60) for _ in range(101)]
    with _replace_dunder_methods(BatchSampler):  # as Lightning builds train_dataloader()
        loader = DataLoader(range(101), batch_sampler=LengthBucketBatchSampler(lengths, 8))
    injected = [
        DistributedSampler(range(101), num_replicas=2, rank=r, shuffle=False) for r in (0, 1)
    ]
    ranks = [_update_dataloader(loader, sampler) for sampler in injected]
    per_epoch = []
    for epoch in range(3):
        for rank_loader in ranks:
            _set_sampler_epoch(rank_loader, epoch)  # what the fit loop does at each epoch
        per_rank = [[b.tolist() for b in rank_loader] for rank_loader in ranks]
        assert len(per_rank[0]) == len(per_rank[1])
        flat = [i for rank in per_rank for b in rank for i in b]
        assert sorted(flat) == list(range(101))  # disjoint across ranks, every sample once
        per_epoch.append(per_rank)
    assert per_epoch[0] != per_epoch[1] != per_epoch[2] != per_epoch[0]


@pytest.mark.parametrize("replicas", [1, 3])
def test_drop_last_drops_random_samples_not_the_longest(replicas: int) -> None:
    """Like a shuffled DataLoader's drop_last: the dropped remainder changes with the epoch
    and does not favour long samples (sorted pools' tails are the longest)."""
    lengths = list(range(1, 31))  # sample i has length i + 1
    dropped_lengths: list[int] = []
    dropped_sets = set()
    for epoch in range(40):
        kept: list[int] = []
        for s in [LengthBucketBatchSampler(lengths, 4, num_replicas=replicas, rank=r,
                                           drop_last=True) for r in range(replicas)]:  # fmt: skip
            s.set_epoch(epoch)
            rank_batches = list(s)
            assert all(len(b) == 4 for b in rank_batches)
            kept.extend(i for b in rank_batches for i in b)
        assert len(kept) == len(set(kept)) == 30 // (4 * replicas) * 4 * replicas
        dropped = set(range(30)) - set(kept)
        dropped_sets.add(frozenset(dropped))
        dropped_lengths.extend(lengths[i] for i in dropped)
    assert len(dropped_sets) > 20
    # A fair draw drops lengths averaging 15.5; always the longest would average 28 or more.
    assert 11 < sum(dropped_lengths) / len(dropped_lengths) < 20
    assert min(dropped_lengths) <= 3


@pytest.mark.parametrize(
    ("lengths", "index", "shown"),
    [([1, float("nan")], 1, "nan"), ([5, -3], 1, "-3"), ([4, 2, float("inf")], 2, "inf")],
    ids=["nan", "negative", "infinite"],
)
def test_lengths_that_are_not_finite_and_non_negative_are_refused_by_index(
    lengths: list[float], index: int, shown: str
) -> None:
    """Issue 33: NaN raised torch's raw overflow error, and -3 was accepted."""
    with pytest.raises(SpeedkitConfigError) as raised:
        LengthBucketBatchSampler(lengths, 1)  # type: ignore[arg-type]
    message = str(raised.value)
    expected = f"`lengths[{index}]` must be a finite length of 0 or more, got {shown};"
    assert message.startswith(expected)
    assert "overflow" not in message


def test_lengths_that_are_not_numbers_are_refused() -> None:
    with pytest.raises(SpeedkitConfigError, match=r"^`lengths` must be one number per sample"):
        LengthBucketBatchSampler(["a", "bb"], 1)  # type: ignore[list-item]


class _Bucketed(SpeedDataModuleMixin, L.LightningDataModule):
    """The mixin's bucketed loader: 40 samples of lengths 1..7, 10 batches an epoch."""

    def __init__(self, **loader: Any) -> None:
        super().__init__()
        self.loader = loader

    def train_dataloader(self) -> DataLoader[Any]:
        lengths = [i % 7 + 1 for i in range(40)]
        return self.speed_dataloader(list(range(40)), batch_size=4, shuffle=True, seed=3,
                                     lengths=lengths, collate_fn=torch.tensor,
                                     **self.loader)  # fmt: skip


class _Indices(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch.tolist())
        return self.layer(batch.float()[:, None]).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _batches(data: _Bucketed, tmp_path: Path, steps: int = -1, ckpt: Path | None = None,
             every: int = 0) -> list[list[int]]:  # fmt: skip
    """The batches a fit of 2 epochs (or ``steps``) trains on, saving a checkpoint
    ``every`` steps and resuming from ``ckpt``."""
    model = _Indices()
    saves = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every, save_top_k=-1)]
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, max_steps=steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=bool(every),
                        callbacks=saves if every else [])  # fmt: skip
    trainer.fit(model, datamodule=data, ckpt_path=str(ckpt) if ckpt else None)
    return model.seen


@pytest.mark.parametrize("stop", [3, 13, 10], ids=["epoch-0", "epoch-1", "at-an-epoch-end"])
@pytest.mark.parametrize(
    "loader", [{}, {"num_workers": 1, "persistent_workers": True}], ids=["in-process", "worker"]
)
def test_the_mixins_bucketed_loader_resumes_mid_epoch_where_it_stopped(
    tmp_path: Path, stop: int, loader: dict[str, Any]
) -> None:
    """Lightning loads a train loader's state before it iterates and runs only the epoch's
    remaining batch count. A plain DataLoader started the epoch's order again: the resumed
    epoch trained its first batches twice and its last never. Now the resumed run's batches
    are exactly the uninterrupted run's, in the order it had them."""
    uninterrupted = _batches(_Bucketed(**loader), tmp_path / "full")
    _batches(_Bucketed(**loader), tmp_path / "part", steps=stop, every=stop)
    (ckpt,) = (tmp_path / "part").glob("*.ckpt")
    resumed = _batches(_Bucketed(**loader), tmp_path / "rest", ckpt=ckpt, every=stop)
    assert uninterrupted[:stop] + resumed == uninterrupted
    assert len(uninterrupted) == 20
    epoch = sorted(i for batch in uninterrupted[:10] for i in batch)
    assert epoch == list(range(40))


def test_the_bucketed_loaders_state_goes_on_after_the_batches_served() -> None:
    """Without a Trainer: the state says the epoch and the batches served; a loader that
    loads it serves the rest of that epoch, or, where all were served, the next epoch."""
    data = _Bucketed()
    full = data.train_dataloader()
    epoch = [batch.tolist() for batch in full]
    interrupted = data.train_dataloader()
    served = iter(interrupted)
    first = [next(served).tolist() for _ in range(4)]
    assert interrupted.state_dict() == {"epoch": 0, "batches": 4}
    resumed = data.train_dataloader()
    resumed.load_state_dict(interrupted.state_dict())
    assert first + [batch.tolist() for batch in resumed] == epoch
    assert len(resumed) == 10  # the epoch's length, as Lightning counts it
    ended = data.train_dataloader()
    ended.load_state_dict({"epoch": 0, "batches": 10})
    full.batch_sampler.set_epoch(1)  # type: ignore[union-attr]
    assert [batch.tolist() for batch in ended] == [batch.tolist() for batch in full]


def test_lightnings_distributed_rebuild_keeps_the_loader_resumable() -> None:
    """Under DDP Lightning builds the loader again around a ``DistributedSampler`` (as its
    own class, from the arguments the hook gave it): each rank's loader resumes its share."""
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import BatchSampler, DistributedSampler

    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        built = _Bucketed().train_dataloader()  # as Lightning calls train_dataloader()
    for rank in (0, 1):
        sampler = DistributedSampler(range(40), num_replicas=2, rank=rank, shuffle=False)
        share = [b.tolist() for b in _update_dataloader(built, sampler)]
        interrupted = _update_dataloader(built, sampler)
        served = iter(interrupted)
        first = [next(served).tolist() for _ in range(2)]
        resumed = _update_dataloader(built, sampler)
        resumed.load_state_dict(interrupted.state_dict())
        assert first + [b.tolist() for b in resumed] == share
        assert len(share) == 5
