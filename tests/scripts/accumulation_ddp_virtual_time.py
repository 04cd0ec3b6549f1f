"""accumulation_ddp.py on a virtual clock: the adaptive decisions come out the same every run.

Every ``time.sleep`` of that script (``--slow-comm`` in the all-reduce hook,
``--step-delay`` in ``training_step``) advances a per-process clock instead of
waiting, and AccumulationScheduler reads that clock where it would read
``time.perf_counter``. The measured communication is then exactly the delay of the
synchronising micro-batch's all-reduce, and each micro-batch's compute exactly
``--step-delay``: what the scheduler decides depends on where it puts ``no_sync`` and
how it times its windows, not on the machine's load.
"""

from __future__ import annotations

import accumulation_ddp  # this directory is the script's first import path

from lightning_speedkit.measure import _clock


class VirtualTime:
    """``sleep`` and ``perf_counter`` on a clock that moves only when slept on."""

    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def perf_counter(self) -> float:
        return self.now


if __name__ == "__main__":
    clock = VirtualTime()
    accumulation_ddp.time = clock  # type: ignore[assignment]
    _clock._host_time = clock.perf_counter  # the clock AccumulationScheduler reads
    accumulation_ddp.main()
