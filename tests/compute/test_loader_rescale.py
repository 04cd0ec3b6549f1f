"""The Trainer's batch counts kept in samples at a new micro-batch; reloaded loaders resized."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit.compute._loader_rescale import batches_in, rescaled_counts, resized
from lightning_speedkit.errors import SpeedkitConfigError

COUNTS = {"limit_train_batches": 16, "val_check_interval": 10}


def test_integer_counts_keep_their_samples_and_say_so() -> None:
    assert rescaled_counts(COUNTS, 4, 8, 100, overfit=False) == {
        "limit_train_batches": (8, "MicroBatchTuner: `limit_train_batches=16` counted batches "
                                   "of 4 (64 samples); it is 8 micro-batches of 8 now, the same "
                                   "samples."),
        "val_check_interval": (5, "MicroBatchTuner: `val_check_interval=10` counted batches of "
                                  "4 (40 samples); it is 5 micro-batches of 8 now, the same "
                                  "samples."),
    }  # fmt: skip


def test_uneven_counts_round_up_and_say_what_they_are_not() -> None:
    scaled, said = rescaled_counts({"limit_train_batches": 5}, 4, 8, None, overfit=False)[
        "limit_train_batches"
    ]
    assert scaled == 3
    assert said == ("MicroBatchTuner: `limit_train_batches=5` counted batches of 4 (20 samples); "
                    "it is 3 micro-batches of 8 now (not 2.5: the batches do not divide evenly), "
                    "24 samples.")  # fmt: skip


def test_a_count_rounded_up_to_one_micro_batch_says_the_samples_it_trains_now() -> None:
    """2 batches of 8 at micro-batch 32: one micro-batch, 32 samples (not the same 16)."""
    assert rescaled_counts({"limit_train_batches": 2}, 8, 32, 16, overfit=False) == {
        "limit_train_batches": (1, "MicroBatchTuner: `limit_train_batches=2` counted batches of "
                                   "8 (16 samples); it is 1 micro-batch of 32 now (not 0.5: the "
                                   "batches do not divide evenly), 32 samples."),
    }  # fmt: skip


def test_an_interval_cut_to_the_new_epoch_says_so() -> None:
    out = rescaled_counts({"limit_train_batches": 4, "val_check_interval": 8}, 2, 4, 50,
                          overfit=False)  # fmt: skip
    assert out["val_check_interval"] == (2, (
        "MicroBatchTuner: `val_check_interval=8` counted batches of 2 (16 samples); it is 2 "
        "micro-batches of 4 now, the whole epoch at that size (8 samples)."))  # fmt: skip


def test_the_validation_interval_stays_within_the_new_epoch() -> None:
    # an interval of a whole epoch of 10 batches of 4 (the last one short): 5 of 8 now, not 6
    counts = {"limit_train_batches": 1.0, "val_check_interval": 10}
    out = rescaled_counts(counts, 4, 8, 5, overfit=False)
    assert out["val_check_interval"][0] == 5
    assert out["limit_train_batches"] == (1.0, None)  # a fraction is a share: kept
    # a limit shortens the epoch the interval must stay within
    out = rescaled_counts({"limit_train_batches": 4, "val_check_interval": 8}, 2, 4, 50,
                          overfit=False)  # fmt: skip
    assert (out["limit_train_batches"][0], out["val_check_interval"][0]) == (2, 2)


def test_unchanged_sizes_booleans_and_overfit_batches_keep_their_counts() -> None:
    assert rescaled_counts(COUNTS, 8, 8, 10, overfit=False) == {
        "limit_train_batches": (16, None), "val_check_interval": (10, None)}  # fmt: skip
    assert rescaled_counts({"limit_train_batches": True}, 4, 8, 10, overfit=False) == {
        "limit_train_batches": (True, None)}  # fmt: skip
    assert rescaled_counts(COUNTS, 4, 8, 100, overfit=True)["limit_train_batches"] == (16, None)


def test_a_reloaded_loader_is_rebuilt_at_the_tuned_size_and_a_foreign_one_refused() -> None:
    loader = DataLoader(TensorDataset(torch.arange(20.0)), batch_size=4, shuffle=False)
    again = resized(loader, 8)
    assert again.batch_size == 8
    assert batches_in(again) == 3
    assert resized(again, 8) is again
    with pytest.raises(SpeedkitConfigError, match="the train loader reloaded for this epoch is a "
                       "list, not a torch DataLoader"):  # fmt: skip
        resized([1, 2], 8)
