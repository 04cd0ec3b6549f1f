"""Throughput arithmetic: samples/s, tokens/s, MFU/HFU, step-time percentiles, data wait.

Trainer-free and clock-free, as Lightning's ``fabric/utilities/throughput.py``: the
caller passes each timed step's samples, tokens and FLOPs (:meth:`Throughput.update`)
and, once per log interval, the step times and data waits its clock measured
(:meth:`Throughput.close`), so tests give exact numbers. Across ranks, the caller
gathers each rank's :meth:`~Throughput.close` row and hands the rows back
(:meth:`Throughput.add`); :func:`figures` turns rows into the logged figures. A
step's tokens may be a 0-d tensor on the device (real tokens counted from a batch's
padding mask): they are summed and read once, when the interval closes.

The run's step-time percentiles come from :class:`StepTimes`: exact for the first
65,536 steps, then from log-spaced buckets (each value within 0.5% of the time it
stands for, DDSketch's scheme: Masson et al. 2019), so a million-step run keeps a few
hundred counts in memory and in its checkpoints, not a million floats.

MFU is model FLOPs per second over the device's peak FLOP/s, HFU the same with
hardware FLOPs (recomputation included): PaLM (Chowdhery et al. 2022), appendix B.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

#: Per-rank raw sums of a log interval, in the order of a gathered row.
FIELDS = ("samples", "tokens", "time", "steps", "model_flops", "hw_flops", "wait", "mem_gib",
          "compute")  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (the smallest value at or above ``q`` percent).

    Example::

        >>> percentile([4.0, 1.0, 3.0, 2.0], 50), percentile([4.0, 1.0, 3.0, 2.0], 99)
        (2.0, 4.0)
    """
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


class StepTimes:
    """Step times (s) for nearest-rank percentiles, in bounded memory: kept exactly up to
    ``exact`` values, then counted in log-spaced buckets whose every value is within
    ``relative`` of the times it counts (DDSketch: Masson et al. 2019).

    Example::

        >>> times = StepTimes([0.5, 0.25], exact=2)
        >>> times.percentiles((50,))  # exact
        {50: 0.25}
        >>> times.extend([0.75])  # a third value: counted in buckets from here on
        >>> {q: round(v, 3) for q, v in times.percentiles((50, 99)).items()}
        {50: 0.499, 99: 0.752}
    """

    def __init__(
        self, values: Iterable[float] = (), exact: int = 1 << 16, relative: float = 0.005
    ) -> None:
        self.exact = exact
        self.values: list[float] = []
        self.buckets: Counter[int] = Counter()
        self._log_gamma = math.log((1 + relative) / (1 - relative))
        self.extend(values)

    def __len__(self) -> int:
        return len(self.values) + self.buckets.total()

    def extend(self, values: Iterable[float]) -> None:
        if not self.buckets:
            self.values.extend(values)
            if len(self.values) <= self.exact:
                return
            values, self.values = self.values, []
        # a time of 0 (a coarse clock) counts at 1 ns: no bucket stands for zero
        self.buckets.update(math.ceil(math.log(max(v, 1e-9)) / self._log_gamma) for v in values)

    def percentiles(self, qs: Iterable[float]) -> dict[float, float]:
        """The nearest-rank ``q``-th percentile for each ``q`` (empty with no values)."""
        if self.values or not self.buckets:
            ordered = sorted(self.values)
            return {q: percentile(ordered, q) for q in qs} if ordered else {}
        keys, gamma = sorted(self.buckets), math.exp(self._log_gamma)
        seen = list(itertools.accumulate(self.buckets[k] for k in keys))
        out: dict[float, float] = {}
        for q in qs:
            index = keys[bisect.bisect_left(seen, max(1, math.ceil(q / 100 * seen[-1])))]
            # the bucket's middle: (gamma^(i-1), gamma^i] stands for 2 gamma^i / (gamma + 1)
            out[q] = 2 * gamma**index / (gamma + 1)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values), "buckets": sorted(self.buckets.items())}

    def load_state_dict(self, state: dict[str, Any] | list[float]) -> None:
        if isinstance(state, list):  # checkpoints before buckets: every step time
            state = {"values": state, "buckets": []}
        self.values, self.buckets = [], Counter(dict(state["buckets"]))
        self.extend(state["values"])


def figures(
    rows: list[list[float]],
    step_times: Iterable[float] | StepTimes,
    peak: float | None,
    gpu_util: Callable[[], float | None] = lambda: None,
) -> dict[str, float]:
    """The figures of per-rank rows (:data:`FIELDS` sums): rates are summed over ranks
    (samples/s, tokens/s) or averaged (FLOP/s per device, data wait); a figure that
    cannot be known is left out. Empty when a rank timed no step.

    Example::

        >>> row = [8, 0, 0.5, 2, 4e12, 5e12, 0.1, 0.0, 0.3]  # 2 steps of 4 samples in 0.5 s
        >>> figures([row], [0.25, 0.25], peak=1e13)
        ... # doctest: +NORMALIZE_WHITESPACE
        {'samples_per_sec': 16.0, 'data_wait_frac': 0.2, 'tflops_per_device': 8.0,
         'mfu': 0.8, 'hfu': 1.0, 'flops_per_sample': 500000000000.0,
         'step_ms_p50': 250.0, 'step_ms_p90': 250.0, 'step_ms_p99': 250.0}
    """
    col = {f: [r[i] for r in rows] for i, f in enumerate(FIELDS)}
    if not all(t > 0 for t in col["time"]):
        return {}
    out: dict[str, float] = {
        "samples_per_sec": sum(s / t for s, t in zip(col["samples"], col["time"], strict=True)),
        "data_wait_frac": statistics.fmean(
            w / t for w, t in zip(col["wait"], col["time"], strict=True)
        ),
    }
    if any(col["tokens"]):
        out["tokens_per_sec"] = sum(k / t for k, t in zip(col["tokens"], col["time"], strict=True))
    if any(col["model_flops"]):
        model_rate = statistics.fmean(
            f / t for f, t in zip(col["model_flops"], col["time"], strict=True)
        )
        hw_rate = statistics.fmean(f / t for f, t in zip(col["hw_flops"], col["time"], strict=True))
        out["tflops_per_device"] = model_rate / 1e12
        if peak:
            out["mfu"] = model_rate / peak
            out["hfu"] = hw_rate / peak
        if sum(col["samples"]):
            out["flops_per_sample"] = sum(col["model_flops"]) / sum(col["samples"])
    times = step_times if isinstance(step_times, StepTimes) else StepTimes(step_times)
    for q, value in times.percentiles((50, 90, 99)).items():
        out[f"step_ms_p{q}"] = 1e3 * value
    if any(col["mem_gib"]):
        out["mem_peak_gib"] = max(col["mem_gib"])
    util = gpu_util()
    if util is not None:
        out["gpu_util"] = util
    if len(rows) > 1 and all(col["steps"]):
        # each rank's compute before the gradients' sync: the sync makes step times equal
        spent = col["compute"] if all(col["compute"]) else col["time"]
        means = [t / n for t, n in zip(spent, col["steps"], strict=True)]
        # over the lower median: of two ranks the faster (the median would average in
        # the slow one itself: 10x slower read 1.8)
        out["straggler_ratio"] = max(means) / statistics.median_low(means)
    return out


class Throughput:
    """One rank's timed steps, summed per log interval and over the run (all ranks).

    Args:
        window: step-time percentiles of an interval cover the last ``window`` steps.

    Example::

        >>> throughput = Throughput(window=100)
        >>> for _ in range(4):
        ...     throughput.update(samples=8, tokens=None, flops=(1e9, 1e9))
        >>> row = throughput.close(step_times=[0.5] * 4, waits=[0.1] * 4, mem_gib=0.0)
        >>> throughput.add([row])
        >>> metrics = throughput.compute([row], peak=None)
        >>> metrics["samples_per_sec"], metrics["data_wait_frac"], metrics["tflops_per_device"]
        (16.0, 0.2, 0.002)
    """

    def __init__(self, window: int) -> None:
        self.run: list[list[float]] = []  # per rank, FIELDS sums over the whole run
        self.run_steps = StepTimes()  # this rank's step times (s), whole run
        self.recent: deque[float] = deque(maxlen=window)
        self.interval = dict.fromkeys(FIELDS, 0.0)
        self._device_tokens: list[torch.Tensor] = []  # the interval's, read at close

    def reset(self) -> None:
        """Forget the run (a new fit; a checkpoint's state may follow), and the interval a
        fit that raised left unlogged: its step times are gone with its clock."""
        self.run, self.run_steps = [], StepTimes()
        self.recent.clear()
        self.interval = dict.fromkeys(FIELDS, 0.0)
        self._device_tokens = []

    def update(
        self,
        *,
        samples: int,
        tokens: int | torch.Tensor | None,
        flops: tuple[float, float] | None,
    ) -> None:
        """One timed step: its samples, tokens (a number, or a 0-d tensor kept unread until
        the interval closes) and (model, hardware) FLOPs, when known."""
        acc = self.interval
        acc["samples"] += samples
        if isinstance(tokens, torch.Tensor):
            self._device_tokens.append(tokens.detach().reshape(()))
        else:
            acc["tokens"] += tokens or 0
        acc["steps"] += 1
        if flops is not None:
            acc["model_flops"] += flops[0]
            acc["hw_flops"] += flops[1]

    def close(
        self,
        *,
        step_times: list[float],
        waits: list[float],
        mem_gib: float,
        computes: list[float] | None = None,
    ) -> list[float]:
        """End the log interval with its step times, data waits and computes before the
        gradients' sync (seconds; none: not known) and the peak memory; this rank's row of
        :data:`FIELDS` sums, to gather across ranks."""
        acc, self.interval = self.interval, dict.fromkeys(FIELDS, 0.0)
        pending, self._device_tokens = self._device_tokens, []
        if pending:  # SYNC: log time only, the interval's token counts in one read
            acc["tokens"] += float(torch.stack([t.long() for t in pending]).sum())
        acc["time"] = sum(step_times)
        acc["wait"] = sum(waits)
        acc["mem_gib"] = mem_gib
        acc["compute"] = sum(computes or ())
        self.recent.extend(step_times)
        self.run_steps.extend(step_times)
        return [acc[f] for f in FIELDS]

    def add(self, rows: list[list[float]]) -> None:
        """Add every rank's interval row to the run (peak memory: the largest)."""
        if len(self.run) != len(rows):
            self.run = [[0.0] * len(FIELDS) for _ in rows]
        for run, row in zip(self.run, rows, strict=True):
            for i, field in enumerate(FIELDS):
                run[i] = max(run[i], row[i]) if field == "mem_gib" else run[i] + row[i]

    def compute(
        self,
        rows: list[list[float]],
        peak: float | None,
        gpu_util: Callable[[], float | None] = lambda: None,
    ) -> dict[str, float]:
        """The figures of an interval's rows, percentiles over the last ``window`` steps."""
        return figures(rows, list(self.recent), peak, gpu_util)

    def summary(
        self, peak: float | None, gpu_util: Callable[[], float | None] = lambda: None
    ) -> dict[str, float]:
        """The figures of the whole run (empty before its first interval)."""
        return figures(self.run, self.run_steps, peak, gpu_util) if self.run else {}

    def state_dict(self) -> dict[str, Any]:
        return {"run": [list(r) for r in self.run], "run_steps": self.run_steps.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # a checkpoint's rows from before a field was added: zero, that figure unknown
        self.run = [[*r, *[0.0] * (len(FIELDS) - len(r))] for r in state_dict.get("run", [])]
        self.run_steps = StepTimes()
        self.run_steps.load_state_dict(state_dict.get("run_steps", []))
