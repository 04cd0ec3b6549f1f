"""A clock that moves only when a test says so: timing logic asserted to exact values."""

from __future__ import annotations


class VirtualClock:
    """Time that passes only when the test's model, dataset or hooks "sleep".

    Patch a module's clock with the instance (it is called like ``time.perf_counter``)
    and ``tests.helpers.models._sleep`` with :meth:`sleep`.
    """

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
