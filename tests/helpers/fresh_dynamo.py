"""An autouse fixture for tests that count what torch.compile makes.

Import it into a test module (``from tests.helpers.fresh_dynamo import fresh_dynamo``) and
every test there compiles from nothing and reads its own dynamo counters (graphs,
recompiles, breaks), whatever compiled before it in the same process.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch._dynamo.utils import counters


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
