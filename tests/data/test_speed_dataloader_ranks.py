"""``speed_dataloader(lengths=..., num_replicas=..., rank=...)`` outside Lightning's hooks:
each rank gets its own bucketed batches, every sample once over the ranks. Before, the two
arguments went on to ``DataLoader`` and raised its bare ``TypeError``."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_speedkit import SpeedDataModuleMixin, SpeedkitConfigError


class Data(SpeedDataModuleMixin, L.LightningDataModule):
    pass


def test_each_rank_gets_its_share_of_the_bucketed_batches() -> None:
    samples, lengths = list(range(20)), [1 + (7 * i) % 13 for i in range(20)]
    shares = [
        [list(map(int, batch)) for batch in Data().speed_dataloader(
            samples, batch_size=3, lengths=lengths, num_replicas=2, rank=rank, shuffle=True)]
        for rank in (0, 1)
    ]  # fmt: skip
    assert len(shares[0]) == len(shares[1])  # the same number of steps on each rank
    seen = sorted(i for share in shares for batch in share for i in batch)
    assert seen == samples  # each sample once over the two ranks
    assert all(0 < len(batch) <= 3 for share in shares for batch in share)


def test_ranks_without_lengths_are_refused_with_the_fix() -> None:
    with pytest.raises(SpeedkitConfigError, match=r"no `lengths` were given; pass `lengths=`"):
        Data().speed_dataloader(list(range(8)), batch_size=2, num_replicas=2, rank=0)
