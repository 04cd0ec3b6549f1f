"""Set figures and fake clocks for the worker search and NumWorkersTuner: no test of a pick
depends on how busy the machine is."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from torch.utils.data import DataLoader

from lightning_speedkit.data import num_workers_tuner, worker_search

Rates = dict[Any, float] | Callable[[DataLoader[Any]], float]


class Figures:
    """Set batches/s per candidate, keyed by ``num_workers`` or by ``(num_workers,
    prefetch_factor)``, or a function of the trial loader. A candidate with no figure fails
    as a crashed worker does. Usable as ``measure=`` and in place of the search's ``_measure``.
    """

    def __init__(self, rates: Rates) -> None:
        self.rates = rates
        self.seen: list[tuple[int, int | None]] = []

    def rate(self, trial: DataLoader[Any]) -> float:
        key = (trial.num_workers, trial.prefetch_factor if trial.num_workers else None)
        self.seen.append(key)
        if callable(self.rates):
            return self.rates(trial)
        rate = self.rates.get(key, self.rates.get(trial.num_workers))
        if rate is None:
            raise RuntimeError("DataLoader worker (pid 4242) exited unexpectedly")
        return rate

    def __call__(self, trial: DataLoader[Any], *timing: Any, **kw: Any) -> float:
        return self.rate(trial)


class StepClock:
    """A clock whose n-th reading is ``n * step_s`` seconds: each reading is ``step_s`` after
    the one before (0 stops it)."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        return self.readings * self.step_s


@pytest.fixture
def paced(monkeypatch: pytest.MonkeyPatch) -> Callable[[Rates], Figures]:
    """The search's own measuring loop over the real trial loaders, timed on a clock on
    which a candidate delivers one batch every ``1 / rate`` seconds: each candidate
    measures exactly its figure (real batches, real workers, no wall clock). The search's
    time budget is never spent."""

    def install(rates: Rates) -> Figures:
        figures = Figures(rates)
        real = worker_search._measure

        def measure(trial: DataLoader[Any], *args: Any, **kwargs: Any) -> float:
            kwargs["clock"] = StepClock(1.0 / figures.rate(trial))
            return real(trial, *args, **kwargs)

        monkeypatch.setattr(worker_search, "_measure", measure)
        monkeypatch.setattr(worker_search, "_clock", StepClock(0.0))
        return figures

    return install


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Figures]:
    """In-Trainer tests: candidates get set figures in place of being measured, training
    steps last ``step_s`` on the verdict's clock, and the search's time budget is never spent.
    """

    def install(rates: Rates, step_s: float = 0.001) -> Figures:
        fake = Figures(rates)
        monkeypatch.setattr(worker_search, "_measure", fake)
        monkeypatch.setattr(worker_search, "_clock", StepClock(0.0))
        monkeypatch.setattr(num_workers_tuner, "_clock", StepClock(step_s))
        return fake

    return install
