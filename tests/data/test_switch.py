"""switch_loader: the rest of an epoch on other worker settings, every sample once, in order."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_speedkit.data._switch import switch_loader, why_not_switched


class Where(Dataset[dict[str, int]]):
    """Each sample says which it is and which process loaded it."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict[str, int]:
        return {"index": i, "pid": os.getpid()}


def _settings(workers: int) -> dict[str, Any]:
    return {"num_workers": workers, "persistent_workers": workers > 0,
            "prefetch_factor": 2 if workers else None}  # fmt: skip


@pytest.mark.parametrize(("before", "after"), [(0, 2), (1, 2), (2, 0)])
@pytest.mark.parametrize("persistent", [False, True], ids=["", "persistent"])
def test_the_rest_of_the_epoch_is_every_unseen_sample_once_in_the_epochs_order(
    before: int, after: int, persistent: bool
) -> None:
    """Shuffled without a generator of its own (the common case, whose order cannot be
    drawn again): the batches after the switch are exactly those the epoch had left."""

    def loader() -> DataLoader[Any]:
        return DataLoader(Where(), batch_size=4, shuffle=True, num_workers=before,
                          persistent_workers=persistent and before > 0)  # fmt: skip

    torch.manual_seed(7)
    expected = [batch["index"].tolist() for batch in loader()]
    torch.manual_seed(7)
    old = loader()
    running = iter(old)
    seen = [next(running) for _ in range(3)]
    new, rest = switch_loader(old, running, _settings(after))
    after_switch = list(rest)
    assert [b["index"].tolist() for b in seen + after_switch] == expected
    assert new.num_workers == after  # later epochs
    assert new.sampler is old.sampler
    assert len(new) == len(old) == 10
    # Beyond what the old workers already held (prefetch_factor 2 each), the new loader's
    # processes loaded the rest.
    held = 2 * before
    pids = {int(p) for b in after_switch[held:] for p in b["pid"]}
    if after == 0:
        assert pids == {os.getpid()}
    else:
        assert os.getpid() not in pids
        assert len(pids) == after
        assert pids.isdisjoint(int(p) for b in after_switch[:held] for p in b["pid"])


def test_a_batch_sampler_of_the_users_and_unbatched_loading_go_on_where_they_were() -> None:
    batches = [[3, 1], [0], [9, 8, 7], [2, 4, 5, 6]]
    old: DataLoader[Any] = DataLoader(Where(), batch_sampler=batches)
    running = iter(old)
    first = next(running)["index"].tolist()
    _, rest = switch_loader(old, running, _settings(1))
    assert [first] + [b["index"].tolist() for b in rest] == batches
    unbatched: DataLoader[Any] = DataLoader(Where(), batch_size=None, sampler=[5, 2, 7])
    running = iter(unbatched)
    assert next(running)["index"] == 5
    _, rest = switch_loader(unbatched, running, _settings(0))
    assert [sample["index"] for sample in rest] == [2, 7]


class Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(8))


class Resumable(DataLoader):  # type: ignore[type-arg]
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@pytest.mark.parametrize("generator", [False, True], ids=["global", "own generator"])
def test_the_switch_draws_no_number_of_the_runs(generator: bool) -> None:
    """Starting the rest's workers draws their base seed; the untuned run made no such
    draw mid-epoch, so every later number (the next epoch's shuffle, dropout) differed."""
    own = torch.Generator().manual_seed(3) if generator else None
    old = DataLoader(Where(), batch_size=4, shuffle=True, generator=own)
    running = iter(old)
    next(running)
    torch.manual_seed(11)
    before = (torch.get_rng_state(), own.get_state() if own is not None else None)
    _, rest = switch_loader(old, running, _settings(2))
    assert torch.equal(torch.get_rng_state(), before[0])
    if own is not None:
        assert torch.equal(own.get_state(), before[1])
    assert len(list(rest)) == 9


def test_what_cannot_switch_mid_epoch_says_why() -> None:
    stream: DataLoader[Any] = DataLoader(Stream(), batch_size=2)
    assert "IterableDataset" in str(why_not_switched(stream, iter(stream)))
    resumable = Resumable(Where(), batch_size=2)
    assert "mid-epoch resume" in str(why_not_switched(resumable, iter(resumable)))
    plain: DataLoader[Any] = DataLoader(Where(), batch_size=2)
    assert why_not_switched(plain, iter([1, 2])) == (
        "its iterator, a list_iterator, is not a torch DataLoader's"
    )
    assert why_not_switched(plain, iter(plain)) is None
    with pytest.raises(ValueError, match="IterableDataset"):
        switch_loader(stream, iter(stream), _settings(1))


def test_the_mixins_resumable_bucketed_loader_switches_and_counts_on() -> None:
    """``speed_dataloader(lengths=...)``'s loader saves its place as the batches served of
    the epoch, which hold for any workers: it switches in the middle of an epoch (a
    ``state_dict`` alone no longer makes it wait), and the new loader counts on."""
    import lightning as L

    from lightning_speedkit import SpeedDataModuleMixin

    class Data(SpeedDataModuleMixin, L.LightningDataModule):
        pass

    def loader() -> DataLoader[Any]:
        return Data().speed_dataloader(Where(), batch_size=4, shuffle=True, seed=2,
                                       lengths=[i % 5 + 1 for i in range(40)])  # fmt: skip

    expected = [batch["index"].tolist() for batch in loader()]
    old = loader()
    running = iter(old)
    assert why_not_switched(old, running) is None
    seen = [next(running)["index"].tolist() for _ in range(3)]
    new, rest = switch_loader(old, running, _settings(2))
    seen += [next(rest)["index"].tolist() for _ in range(2)]
    assert new.state_dict() == {"epoch": 0, "batches": 5}  # type: ignore[attr-defined]
    assert seen + [batch["index"].tolist() for batch in rest] == expected
    assert new.num_workers == 2
