"""An autouse fixture for tests that compare a frozen tower's served features bitwise.

Import it into a test module (``from tests.helpers.one_thread import one_intra_op_thread``)
and every test there runs with one intra-op thread: with two, a tower's output for a
sample can depend on where in the batch it runs (the threads split the work by position),
so features served from another batch differ from the plain run's in their last bits.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
