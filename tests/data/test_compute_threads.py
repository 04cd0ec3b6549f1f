"""torch's threads for the model during a fit, and torch's own count put back after."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lightning_speedkit.data._compute_threads import ComputeThreads


@pytest.fixture
def three_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("three_threads")
def test_threads_are_given_within_the_cores_and_put_back_once() -> None:
    threads = ComputeThreads()
    assert threads.give(3, cores=4) is None  # already so: nothing changes, nothing to undo
    assert threads.before is None
    assert threads.give(8, cores=2) == (
        "NumWorkersTuner: torch now computes with 2 of this rank's 2 cores (was 3), leaving "
        "the rest to loader workers."
    )
    assert threads.give(1, cores=2) is not None
    assert torch.get_num_threads() == 1
    threads.restore()
    assert torch.get_num_threads() == 3  # the count from before the first give
    torch.set_num_threads(2)
    threads.restore()  # nothing given since: left alone
    assert torch.get_num_threads() == 2
