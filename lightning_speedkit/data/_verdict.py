"""What NumWorkersTuner judges, without a Trainer: whether data loading is the bottleneck,
how many cores loader workers may have on CPU, whether the compute leaves cores idle for a
new search, and the words for each. Pure functions of rates (batches/s), step times
(seconds) and core and thread counts; the callback reads the clock and the machine."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lightning_speedkit.data import worker_search
from lightning_speedkit.data.tune_result import TuneResult
from lightning_speedkit.data.worker_cores import spare_cores

ADVICE = " Consider more CPU for decoding, lighter transforms, or pre-decoded data."


def describe(settings: dict[str, Any]) -> str:
    """``settings`` as ``key=value`` pairs, the unset (None) left out.

    Example::

        >>> describe({"num_workers": 0, "prefetch_factor": None})
        'num_workers=0'
    """
    return ", ".join(f"{k}={v}" for k, v in settings.items() if v is not None)


class StepPace:
    """Training steps' times for the verdict: the first ``warmup`` steps left out (start-up,
    compilation, the loader's first batches), then ``steps`` kept. The caller times them.

    Example::

        >>> pace = StepPace(steps=2, warmup=1)
        >>> [pace.add(seconds) for seconds in (9.0, 0.5, 0.25)]
        [False, False, True]
        >>> pace.times
        [0.5, 0.25]
    """

    def __init__(self, steps: int, warmup: int = 3) -> None:
        self.steps, self.warmup = steps, warmup
        self.seen = 0
        self.times: list[float] = []

    def timing(self) -> bool:
        """Whether the next step counts (the warm-up is over): read the clock only then."""
        return self.seen >= self.warmup

    def add(self, seconds: float | None) -> bool:
        """Count one step that took ``seconds`` (None: a warm-up step, not timed); whether
        ``steps`` are timed now."""
        self.seen += 1
        if self.seen > self.warmup and seconds is not None:
            self.times.append(seconds)
        return len(self.times) >= self.steps


def verdict(step_times: Sequence[float], loader_rate: float) -> dict[str, Any]:
    """Whether data loading holds the model back: the rate the model consumes batches at
    (one over the median step time, in seconds) against the rate the loader delivers.

    Example::

        >>> verdict([0.001, 0.002, 0.001], loader_rate=10.3)
        {'data_bound': True, 'loader_batches_per_sec': 10.3, 'model_batches_per_sec': 1000.0}
    """
    model_rate = 1.0 / statistics.median(step_times)
    return {
        "data_bound": loader_rate < model_rate,
        "loader_batches_per_sec": loader_rate,
        "model_batches_per_sec": model_rate,
    }


def verdict_message(bottleneck: dict[str, Any]) -> str:
    """What :func:`verdict` found, in a sentence, with advice when data is the bottleneck."""
    bound = bottleneck["data_bound"]
    loader_rate = bottleneck["loader_batches_per_sec"]
    model_rate = bottleneck["model_batches_per_sec"]
    margin = f" ({model_rate / loader_rate:.1f}x)" if bound and loader_rate > 0 else ""
    return (
        "NumWorkersTuner: data loading "
        + ("IS the bottleneck" if bound else "is not the bottleneck")
        + f": the loader delivers {loader_rate:.1f} batches/s, the model consumes "
        f"{model_rate:.1f}{margin}." + (ADVICE if bound else "")
    )


def start_metrics(best: dict[str, Any], in_use: TuneResult | None) -> dict[str, float]:
    """What is logged as training starts: the workers in use and, when measured, their rate."""
    metrics = {"data/num_workers": float(best.get("num_workers", 0))}
    if in_use is not None and in_use.untuned is None:  # an untuned loader has no rate
        metrics["data/loader_batches_per_sec"] = in_use.best_batches_per_sec
    return metrics


def not_tuned_message(loader: Any) -> str:
    """Why a train loader that is not one torch DataLoader is left as it is."""
    return (
        f"NumWorkersTuner tunes a single torch DataLoader; the train loader is a "
        f"{type(loader).__name__}, so it is left as it is."
    )


def tuned_message(result: TuneResult, best: dict[str, Any]) -> str:
    """What the search at setup chose (``best``, the settings every rank uses) and how fast."""
    r = result
    if r.untuned is not None:  # a warning said why
        return f"NumWorkersTuner: {describe(best)}: the loader as given, untuned."
    gain = ""
    if r.given_batches_per_sec:
        gain = f", {r.best_batches_per_sec / r.given_batches_per_sec:.2f}x the loader as given"
    how = "cached" if r.cached else f"tuned in {r.seconds:.1f} s"
    rate = f"{r.best_batches_per_sec:.1f} batches/s"
    return f"NumWorkersTuner: {describe(best)}: {rate}{gain} ({how})."


def worker_budget(cores: int, on_cpu: bool, threads: int) -> tuple[int, str | None]:
    """The workers this rank's ``cores`` can have without starving the training process,
    and what to tell the user when that is none on CPU (None when there is nothing to say).
    On an accelerator one core drives the device; on CPU torch's ``threads`` compute.

    Example::

        >>> worker_budget(4, on_cpu=False, threads=4)
        (3, None)
        >>> worker_budget(4, on_cpu=True, threads=2)
        (2, None)
        >>> worker_budget(1, on_cpu=True, threads=1)[0]
        0
    """
    if not on_cpu:
        return max(0, cores - 1), None  # one core drives the device
    budget = max(0, cores - threads)
    if budget == 0 and cores == 1:
        return budget, (
            "NumWorkersTuner: training on CPU with one core for this rank, which torch "
            "computes on: a loader worker would only take turns with the model."
        )
    if budget == 0:
        return budget, (
            f"NumWorkersTuner: training on CPU, torch's {threads} threads use "
            f"all {cores} of this rank's cores, so no loader worker would get a core of its "
            f"own, unless the verdict finds the model leaving cores idle; pass "
            f"`compute_threads` (fewer than {cores}) to leave some to workers from the start."
        )
    return budget, None


def cores_to_search(
    cores: int,
    threads: int,
    model_rate: float,
    in_use: TuneResult,
    searched: int,
) -> tuple[int, str] | None:
    """Training on CPU with data behind the model: the cores to measure loader workers on
    now, and why; None when the compute leaves no more idle than the search had.

    One loading process delivers the loader's rate over its workers (or its rate with
    none); :func:`~lightning_speedkit.data.worker_cores.spare_cores` says how many of
    ``cores`` the compute does not need at that pace.

    Example::

        >>> in_use = TuneResult({"num_workers": 0}, [], best_batches_per_sec=10.3)
        >>> cores_to_search(2, 2, model_rate=731.0, in_use=in_use, searched=0)[0]
        2
        >>> fast = TuneResult({"num_workers": 0}, [], best_batches_per_sec=94.0)
        >>> cores_to_search(2, 2, model_rate=34.0, in_use=fast, searched=0) is None
        True
    """
    per_process = in_use.best_batches_per_sec / max(1, in_use.best.get("num_workers", 0))
    spare = spare_cores(cores, threads, model_rate, per_process)
    if spare <= searched:
        return None
    return spare, (
        f"NumWorkersTuner: at the loader's pace the model needs about "
        f"{threads * min(1.0, cores * per_process / model_rate):.2g} of this rank's "
        f"{_cores(cores)}, not the {min(threads, cores)} its threads were left; measuring "
        f"loader workers on {_cores(spare)} (training waits)."
    )


def _cores(count: int) -> str:
    """``count`` cores, in words: ``1 core``, ``2 cores``."""
    return f"{count} core" if count == 1 else f"{count} cores"


def judge_found(found: TuneResult, in_use: TuneResult) -> tuple[bool, str]:
    """Whether a search on spare cores found settings that beat the loader in use, and
    the sentence that says so.

    Example::

        >>> in_use = TuneResult({"num_workers": 0}, [], best_batches_per_sec=10.0)
        >>> judge_found(TuneResult({"num_workers": 2}, [], 24.0), in_use)
        (True, 'NumWorkersTuner: num_workers=2: 24.0 batches/s, 2.40x the loader in use.')
        >>> judge_found(TuneResult({"num_workers": 0}, [], 10.2), in_use)
        (False, 'NumWorkersTuner: no setting beat num_workers=0; the loader stays.')
    """
    if found.best == in_use.best or found.best_batches_per_sec <= 0:
        return False, f"NumWorkersTuner: no setting beat {describe(in_use.best)}; the loader stays."
    gain = f"{found.best_batches_per_sec / in_use.best_batches_per_sec:.2f}x"
    return True, (
        f"NumWorkersTuner: {describe(found.best)}: {found.best_batches_per_sec:.1f} "
        f"batches/s, {gain} the loader in use."
    )


def search_spare_cores(
    loader: DataLoader[Any],
    in_use: TuneResult,
    model_rate: float,
    *,
    cores: int,
    threads: int,
    searched: int,
    tune_kwargs: dict[str, Any],
) -> TuneResult | None:
    """Training on CPU with data behind the model: measure ``loader`` with workers on the
    cores the compute leaves idle (:func:`cores_to_search`), and return the result when it
    beats the loader in use; None when there are no more cores than ``searched`` or
    nothing won. ``tune_kwargs`` go to :func:`~lightning_speedkit.data.tune_num_workers`,
    its ``max_workers`` set to the spare cores. Each step is said to the user.
    """
    search = cores_to_search(cores, threads, model_rate, in_use, searched)
    if search is None:
        return None
    spare, why = search
    rank_zero_info(why)
    result = worker_search.tune_num_workers(loader, **{**tune_kwargs, "max_workers": spare})
    better, said = judge_found(result, in_use)
    rank_zero_info(said)
    return result if better else None
