"""MicroBatchTuner: the fastest micro-batch that fits, the global batch kept, nothing disturbed."""

from __future__ import annotations

import collections
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from lightning_speedkit import (
    AccumulationScheduler,
    MicroBatchTuner,
    NumWorkersTuner,
    SpeedkitConfigError,
)
from lightning_speedkit.compute import (
    StepMeasurement,
    memory_limit,
    timed_measure,
    tune_micro_batch,
)
from lightning_speedkit.compute.micro_batch_search import table_text
from lightning_speedkit.data import LengthBucketBatchSampler

from ..helpers.recorder import Recorder
from .models import Losses, Net, dataset, trainer

# Seconds per step by micro-batch: samples/s 100, 160, 200, 229, 213, 188 -> 8 is the fastest
SECONDS = {1: 0.010, 2: 0.0125, 4: 0.020, 8: 0.035, 16: 0.075, 32: 0.170}


def fake_measure(
    seconds: dict[int, float], peak: Callable[[int], int | None] = lambda n: None
) -> tuple[Callable[[Callable[[], None], int], StepMeasurement], list[int]]:
    """A measure that really runs the step once, and reports the given figures."""
    ran: list[int] = []

    def measure(run: Callable[[], None], n: int) -> StepMeasurement:
        run()
        ran.append(n)
        return StepMeasurement(seconds[n], peak(n))

    return measure, ran


def _setup(
    n: int = 64, batch_norm: bool = False
) -> tuple[nn.Module, DataLoader[Any], Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(32) if batch_norm else nn.Identity()
    model = nn.Sequential(nn.Linear(16, 32), norm, nn.Dropout(0.5), nn.Linear(32, 1))
    data = TensorDataset(torch.randn(n, 16), torch.randn(n, 1))
    loader = DataLoader(
        data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5)
    )

    def step(batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)

    return model, loader, step


def test_the_fastest_in_samples_per_sec_wins_not_the_largest() -> None:
    model, loader, step = _setup()
    measure, ran = fake_measure(SECONDS)
    result = tune_micro_batch(model, loader, step, global_batch=32, measure=measure)
    # powers of two up to the global batch; then the two fastest, re-timed in turns
    assert ran == [1, 2, 4, 8, 16, 32, 8, 16, 8, 16, 8, 16]
    assert [row["confirmed_samples_per_sec"] for row in result.table] == [
        None, None, None, pytest.approx(8 / 0.035), pytest.approx(16 / 0.075), None
    ]  # fmt: skip
    assert result.best == {"batch_size": 8}
    assert result.best_samples_per_sec == pytest.approx(8 / 0.035)
    assert result.accumulation == 4
    assert result.given == 4
    assert [row["micro_batch"] for row in result.table] == ran[:6]
    assert result.table[3]["samples_per_sec"] == pytest.approx(228.571, rel=1e-4)
    assert result.table[3]["step_ms"] == pytest.approx(35.0)
    assert result.dataloader is not None
    assert result.dataloader.batch_size == 8


def test_a_size_the_step_fails_at_is_skipped() -> None:
    model, loader, step = _setup(batch_norm=True)  # batch norm refuses a batch of one
    measure, ran = fake_measure(SECONDS)
    result = tune_micro_batch(model, loader, step, candidates=[1, 2, 4], measure=measure)
    assert ran == [2, 4, 2, 4, 2, 4, 2, 4]
    assert result.table[0]["skipped"].startswith(
        "the step failed: ValueError: Expected more than 1 value per channel"
    )
    with pytest.raises(ValueError, match="more than 1 value"):  # every size fails: raised
        tune_micro_batch(model, loader, step, candidates=[1], measure=measure)


def test_only_micro_batches_that_keep_the_global_batch_are_tried() -> None:
    model, loader, step = _setup()
    seconds = {n: 0.001 * n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24)}
    measure, ran = fake_measure(seconds)
    # 48 over 2 ranks: 24 per rank; powers of two dividing 24, and the loader's own 4
    tune_micro_batch(model, loader, step, global_batch=48, world_size=2, measure=measure)
    assert ran == [1, 2, 4, 8, 1, 2, 1, 2, 1, 2]  # a tie: the first two are re-timed
    measure, ran = fake_measure(seconds)
    tune_micro_batch(model, loader, step, global_batch=48, world_size=2, measure=measure,
                     candidates=[3, 5, 6, 12, 16, 24])  # fmt: skip
    assert ran == [3, 6, 12, 24, 3, 6, 3, 6, 3, 6]
    measure, ran = fake_measure(seconds)
    tune_micro_batch(model, loader, step, max_micro_batch=6, measure=measure, candidates=[2, 6, 8])
    assert ran == [2, 6, 2, 6, 2, 6, 2, 6]


def test_stops_before_a_micro_batch_predicted_over_the_memory_limit() -> None:
    model, loader, step = _setup()
    measure, ran = fake_measure(SECONDS, peak=lambda n: 1000 + 100 * n)
    # measured: 1 -> 1100, 2 -> 1200, 4 -> 1400, 8 -> 1800; 16 predicted 2600 > 2500
    result = tune_micro_batch(model, loader, step, global_batch=32, measure=measure,
                              limit_bytes=2500)  # fmt: skip
    assert ran == [1, 2, 4, 8, 4, 8, 4, 8, 4, 8]
    assert result.table[-1]["micro_batch"] == 16
    assert result.table[-1]["skipped"].startswith("predicted peak")
    assert result.best == {"batch_size": 8}
    assert result.memory_limit == 2500


def test_a_micro_batch_measured_over_the_limit_does_not_count() -> None:
    model, loader, step = _setup()
    peaks = {1: 100, 2: 110, 4: 5000, 8: 9000}  # 4 jumps past the prediction (130)
    measure, ran = fake_measure({1: 0.01, 2: 0.011, 4: 0.012, 8: 0.013}, peak=peaks.get)
    result = tune_micro_batch(model, loader, step, candidates=[1, 2, 4, 8], measure=measure,
                              limit_bytes=1000)  # fmt: skip
    # the fastest per sample (4) is over the limit; 8 is not tried; 1 and 2 are re-timed
    assert ran == [1, 2, 4, 1, 2, 1, 2, 1, 2]
    assert result.table[2]["fits"] is False
    assert "over the limit" in result.table[2]["skipped"]
    assert result.best == {"batch_size": 2}


def test_out_of_memory_stops_the_search() -> None:
    model, loader, step = _setup()

    def measure(run: Callable[[], None], n: int) -> StepMeasurement:
        if n >= 4:
            raise torch.OutOfMemoryError("pretend")
        run()
        return StepMeasurement(0.01 / n)

    result = tune_micro_batch(model, loader, step, candidates=[2, 4, 8], measure=measure)
    assert [row["micro_batch"] for row in result.table] == [2, 4]
    assert result.table[1]["skipped"] == "out of memory (OutOfMemoryError)"
    assert result.best == {"batch_size": 2}


def test_the_model_and_every_random_state_come_back_as_they_were() -> None:
    model, loader, step = _setup(batch_norm=True)
    model.eval()  # a mode the tuner must put back (it trains the trials in train mode)
    x, y = next(iter(DataLoader(loader.dataset, batch_size=8)))
    F.mse_loss(model(x), y).backward()  # gradients the trials must not touch
    grads = [p.grad.clone() for p in model.parameters()]
    grad_objects = [p.grad for p in model.parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    random.seed(7)
    torch.manual_seed(7)
    expected_draws = (random.random(), torch.rand(3))
    expected_order = list(RandomSampler(loader.dataset, generator=loader.generator))
    random.seed(7)
    torch.manual_seed(7)
    loader.generator.manual_seed(5)
    tune_micro_batch(model, loader, step, candidates=[2, 8, 32], measure=timed_measure("cpu"))
    assert not model.training
    assert all(not m.training for m in model.modules())
    for p, grad, obj in zip(model.parameters(), grads, grad_objects, strict=True):
        assert p.grad is obj
        assert torch.equal(p.grad, grad)
    for key, value in model.state_dict().items():  # weights, and batch-norm statistics
        assert torch.equal(value, state[key]), key
    assert random.random() == expected_draws[0]
    assert torch.equal(torch.rand(3), expected_draws[1])
    loader.generator.manual_seed(5)
    assert list(RandomSampler(loader.dataset, generator=loader.generator)) == expected_order


def test_the_default_measure_times_and_reads_the_peak_on_cpu() -> None:
    measure = timed_measure("cpu", warmup=1, repeats=2, min_seconds=0.0)
    calls: list[int] = []
    measured = measure(lambda: calls.append(1), 4)
    assert len(calls) == 3  # one warm-up, two timed
    assert measured.seconds >= 0
    if measured.peak_bytes is not None:  # Linux /proc
        limit = memory_limit("cpu", memory_headroom=0.5)
        assert limit is not None
        assert 0 < measured.peak_bytes < limit


def test_a_busy_spell_cannot_pick_the_size_and_the_retimed_rates_are_shown() -> None:
    # the probe's fault: 1 timed idle (0.25 ms), 32 in a busy spell (six times slower)
    seen = {1: iter([0.00025, 0.0005, 0.0005, 0.0005]), 2: iter([0.008]),
            32: iter([0.024, 0.004, 0.004, 0.004])}  # fmt: skip
    ran: list[int] = []

    def measure(run: Callable[[], None], n: int) -> StepMeasurement:
        run()
        ran.append(n)
        return StepMeasurement(next(seen[n]))

    model, loader, step = _setup()
    result = tune_micro_batch(model, loader, step, candidates=[1, 2, 32], measure=measure)
    assert ran == [1, 2, 32, 1, 32, 1, 32, 1, 32]
    assert result.best == {"batch_size": 32}
    assert result.best_samples_per_sec == pytest.approx(8000.0)  # the re-timed rate
    assert table_text(result).splitlines()[1:] == [
        "            1     4000.0       0.2          -  re-timed 2000.0/s",
        "            2      250.0       8.0          -  ",
        "           32     1333.3      24.0          -  best, re-timed 8000.0/s",
    ]
    ran.clear()
    seen = {1: iter([0.00025]), 2: iter([0.008]), 32: iter([0.024])}
    off = tune_micro_batch(model, loader, step, candidates=[1, 2, 32], measure=measure,
                           confirm_rounds=0)  # fmt: skip
    assert (ran, off.best) == ([1, 2, 32], {"batch_size": 1})  # the first verdict, unconfirmed


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"candidates": "8"}, r"`candidates` must be a non-empty list"),
        ({"candidates": [4, 0]}, r"`candidates\[1\]` must be an integer >= 1, got 0"),
        ({"max_micro_batch": 0}, r"`max_micro_batch` must be an integer >= 1, got 0"),
        (
            {"candidates": [4, 8], "max_micro_batch": 2},
            r"`max_micro_batch` is below every candidate \(\[4, 8\]\), got 2",
        ),
        ({"memory_headroom": 1.0}, r"`memory_headroom` must be a number in \[0, 1\), got 1.0"),
        ({"confirm_rounds": -1}, r"`confirm_rounds` must be an integer >= 0, got -1"),
        (
            {"candidates": [5, 7], "global_batch": 32},
            r"`candidates` holds no micro-batch that divides the 32",
        ),
        (
            {"global_batch": 33, "world_size": 2},
            r"`global_batch` is not a multiple of the 2 ranks, got 33",
        ),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, Any], match: str) -> None:
    model, loader, step = _setup()
    with pytest.raises(SpeedkitConfigError, match=match):
        tune_micro_batch(model, loader, step, **kwargs)


def test_candidates_may_be_any_iterable_of_sizes() -> None:
    import numpy as np

    model, loader, step = _setup()
    measure, ran = fake_measure(SECONDS)
    tune_micro_batch(model, loader, step, candidates=np.array([8, 2]), measure=measure)
    assert ran == [2, 8, 2, 8, 2, 8, 2, 8]


class Counting(nn.Module):
    """A training step's side effects outside the parameters: a buffer assigned anew, a
    torchmetrics metric, a plain counter."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.linear = nn.Linear(16, 1)
        self.register_buffer("seen", torch.zeros(()))
        self.samples = torchmetrics.SumMetric()
        self.steps = 0
        self.outputs: list[torch.Tensor] = [torch.zeros(1)]  # Lightning's epoch-end pattern
        self.by_size: dict[int, int] = {}
        self.by_split: dict[str, list[int]] = {"train": []}  # a dict of lists
        self.counted: collections.defaultdict[int, int] = collections.defaultdict(int)
        self.rebound: list[int] = []  # the step binds a new list to the name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.seen + x.shape[0]  # a new tensor, not an in-place update
        self.samples.update(torch.tensor(float(x.shape[0])))
        self.steps += 1
        self.outputs.append(x.sum())
        self.by_size[x.shape[0]] = self.by_size.get(x.shape[0], 0) + 1
        self.by_split["train"].append(x.shape[0])
        self.counted[x.shape[0]] += 1
        self.rebound = [*self.rebound, x.shape[0]]
        return self.linear(x)


def test_a_trial_steps_side_effects_are_undone() -> None:
    model = Counting()
    buffer, outputs = model.seen, model.outputs
    loader = DataLoader(TensorDataset(torch.randn(64, 16), torch.randn(64, 1)), batch_size=4)

    def step(batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)

    tune_micro_batch(model, loader, step, candidates=[2, 4, 8], measure=fake_measure(SECONDS)[0])
    assert model.seen is buffer
    assert float(model.seen) == 0.0
    assert model.steps == 0
    assert model.outputs is outputs
    assert len(model.outputs) == 1  # the trials' appends taken out, the list the same object
    assert model.by_size == {}
    assert model.by_split == {"train": []}
    assert model.counted == {}
    assert model.rebound == []
    assert model.samples._update_count == 0
    model.samples.update(torch.tensor(3.0))
    assert float(model.samples.compute()) == 3.0  # nothing of the trials' 14 samples


def test_a_loader_with_a_worker_timeout_is_tried_without_workers() -> None:
    model, loader, step = _setup()
    timed = DataLoader(loader.dataset, batch_size=4, num_workers=1, timeout=30)
    result = tune_micro_batch(model, timed, step, candidates=[2, 4],
                              measure=fake_measure(SECONDS)[0])  # fmt: skip
    assert result.best == {"batch_size": 4}
    assert result.dataloader is not None
    assert (result.dataloader.num_workers, result.dataloader.timeout) == (1, 30)


def test_a_candidate_larger_than_a_drop_last_dataset_stops_the_search() -> None:
    model, loader, step = _setup(n=12)
    short = DataLoader(loader.dataset, batch_size=4, drop_last=True)
    measure, ran = fake_measure(SECONDS)
    result = tune_micro_batch(model, short, step, candidates=[4, 8, 16, 32], measure=measure)
    assert ran == [4, 8, 4, 8, 4, 8, 4, 8]
    assert result.table[-1]["skipped"] == "the dataset holds fewer than 16 samples (drop_last)"


def test_the_cpu_allocators_error_is_out_of_memory() -> None:
    model, loader, step = _setup()

    def measure(run: Callable[[], None], n: int) -> StepMeasurement:
        if n >= 8:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
                               "can't allocate memory: you tried to allocate 1 bytes")  # fmt: skip
        run()
        return StepMeasurement(0.01)

    result = tune_micro_batch(model, loader, step, candidates=[4, 8, 16], measure=measure)
    assert [row["micro_batch"] for row in result.table] == [4, 8]  # 16 is not tried
    assert result.table[1]["skipped"] == "out of memory (RuntimeError)"


def test_samples_are_counted_from_the_sampler_not_guessed_from_the_batch() -> None:
    # Time-major batches (tokens first) and a dict led by a scalar: the first tensor's
    # first dimension is not the number of samples.
    data = TensorDataset(torch.randn(64, 16))
    loader = DataLoader(data, batch_size=4, collate_fn=lambda s: {
        "n": torch.tensor(len(s)), "x": torch.stack([x for (x,) in s]).T})  # fmt: skip
    model = nn.Linear(4, 1, bias=False)

    def step(batch: Any) -> torch.Tensor:
        return model(batch["x"].T.reshape(-1, 4)).sum()

    measure, ran = fake_measure(SECONDS)
    tune_micro_batch(model, loader, step, candidates=[4, 16, 32], measure=measure)
    assert ran == [4, 16, 32, 4, 16, 4, 16, 4, 16]


def test_a_custom_batch_sampler_is_refused_with_the_fix() -> None:
    model, _, step = _setup()
    data = dataset(16)
    bucketed = DataLoader(data, batch_sampler=LengthBucketBatchSampler([1] * 16, 4))
    with pytest.raises(
        SpeedkitConfigError,
        match=r"`dataloader` must batch by `batch_size` \(this one batches with LengthBucket",
    ):
        tune_micro_batch(model, bucketed, step)


# --- the callback ------------------------------------------------------------------------------


def test_the_callback_refuses_without_a_target_global_batch() -> None:
    for callbacks, match in (
        ([], "there is no AccumulationScheduler"),
        ([AccumulationScheduler(schedule={0: 16})], "`schedule`"),
        ([AccumulationScheduler(adaptive=True, max_global_batch=64)], "no `target_global_batch`"),
    ):
        tuner = MicroBatchTuner(measure=fake_measure(SECONDS)[0])
        with pytest.raises(SpeedkitConfigError, match=match) as error:
            trainer(2, [tuner, *callbacks]).fit(Net(), DataLoader(dataset(), batch_size=8))
        if not callbacks:
            assert "AccumulationScheduler(target_global_batch=N)" in str(error.value)


class Seen(Net):
    """Remembers the batch sizes of its training steps and what it was at fit start."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.sizes.append(batch[0].shape[0])
        return super().training_step(batch, batch_idx)


def _collate(samples: list[Any]) -> Any:
    return torch.utils.data.default_collate(samples)


def test_the_callback_trains_with_the_choice_and_accumulation_follows() -> None:
    measure, ran = fake_measure({1: 0.010, 2: 0.011, 4: 0.018, 8: 0.030, 16: 0.070, 32: 0.15})
    tuner = MicroBatchTuner(measure=measure, verbose=False)
    scheduler = AccumulationScheduler(target_global_batch=32, micro_batch_size=4, verbose=False)
    recorder, losses = Recorder(), Losses()
    generator = torch.Generator().manual_seed(3)
    given = DataLoader(dataset(96), batch_size=4, shuffle=True, generator=generator,
                       collate_fn=_collate, drop_last=True)  # fmt: skip
    model = Seen()
    run = trainer(3, [losses, scheduler, tuner], logger=recorder, log_every_n_steps=1)
    run.fit(model, given)
    assert ran == [1, 2, 4, 8, 16, 32, 8, 16, 8, 16, 8, 16]
    assert tuner.result is not None
    assert tuner.result.best == {"batch_size": 8}
    # the loader Lightning trained from: the new size, everything else the user's
    used = run.train_dataloader
    assert used.batch_size == 8
    assert used.collate_fn is _collate
    assert isinstance(used.sampler, RandomSampler)
    assert used.sampler.generator is generator
    assert used.drop_last is True
    # the global batch kept: 3 optimizer steps of 4 micro-batches of 8; the trial steps
    # (the real training_step, one per size) leave nothing in what it collects
    assert model.sizes == [8] * 12
    assert scheduler.history[0].accumulation == 4
    assert scheduler.history[0].global_batch == 32
    assert recorder.last("micro_batch/size") == 8
    assert recorder.last("micro_batch/accumulation") == 4
    assert recorder.last("micro_batch/samples_per_sec") == pytest.approx(8 / 0.030)
    # the batches are the user's loader's, reshaped: the first 8 samples it would give
    generator.manual_seed(3)
    first = next(iter(DataLoader(dataset(96), batch_size=8, shuffle=True, generator=generator)))
    assert torch.equal(losses.batches[0][0], first[0])


@pytest.mark.parametrize(("rounds", "again"), [(0, []), (1, [8, 16]), (2, [8, 16, 8, 16])])
def test_the_callbacks_confirm_rounds_set_how_often_the_two_best_are_retimed(
    rounds: int, again: list[int]
) -> None:
    measure, ran = fake_measure(SECONDS)
    tuner = MicroBatchTuner(confirm_rounds=rounds, measure=measure, verbose=False)
    scheduler = AccumulationScheduler(target_global_batch=32, micro_batch_size=4, verbose=False)
    trainer(1, [scheduler, tuner]).fit(Net(), DataLoader(dataset(96), batch_size=4))
    assert ran == [1, 2, 4, 8, 16, 32, *again]
    assert tuner.result is not None
    assert tuner.result.best == {"batch_size": 8}


def test_the_callback_refuses_negative_confirm_rounds() -> None:
    with pytest.raises(SpeedkitConfigError, match=r"`confirm_rounds` must be an integer >= 0"):
        MicroBatchTuner(confirm_rounds=-1)


class OneCycle(Seen):
    """Sizes its schedule from ``trainer.estimated_stepping_batches``, which loads the
    train loader before any callback's ``on_fit_start``."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        self.estimated = self.trainer.estimated_stepping_batches
        cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=self.estimated)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cycle, "interval": "step"}}


def test_a_loader_loaded_early_for_estimated_stepping_batches_is_replaced() -> None:
    measure, _ = fake_measure({4: 0.04, 8: 0.02, 16: 0.08, 32: 0.2})  # 8 is the fastest
    tuner = MicroBatchTuner([4, 8, 16, 32], measure=measure, verbose=False)
    scheduler = AccumulationScheduler(target_global_batch=32, verbose=False)
    model = OneCycle()
    run = trainer(-1, [scheduler, tuner], max_epochs=2)
    run.fit(model, DataLoader(dataset(128), batch_size=4))
    assert tuner.result is not None
    assert tuner.result.best == {"batch_size": 8}
    assert model.sizes == [8] * 32  # 2 epochs of 16 micro-batches of 8 (trials left none)
    assert scheduler.history[0].accumulation == 4
    assert run.global_step == model.estimated == 8  # 2 epochs of 4 steps of 32 samples


def test_a_fast_dev_run_is_not_tuned() -> None:
    measure, ran = fake_measure(SECONDS)
    tuner = MicroBatchTuner(measure=measure, verbose=False)
    scheduler = AccumulationScheduler(target_global_batch=32, verbose=False)
    run = trainer(-1, [scheduler, tuner], fast_dev_run=True)
    run.fit(Net(), DataLoader(dataset(), batch_size=4))
    assert ran == []
    assert tuner.result is None


class Loader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader subclass, built again as itself at the new size."""


class Scaled(DataLoader):  # type: ignore[type-arg]
    """A subclass with an argument it keeps nowhere: it cannot be built again."""

    def __init__(self, dataset: Any, scale: float, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)


def test_a_dataloader_subclass_keeps_its_class_or_says_what_is_lost() -> None:
    model, given, step = _setup()
    result = tune_micro_batch(model, Loader(given.dataset, batch_size=4), step,
                              candidates=[4, 8], measure=fake_measure(SECONDS)[0])  # fmt: skip
    assert type(result.dataloader) is Loader
    assert result.dataloader.batch_size == 8
    with pytest.warns(UserWarning, match="a Scaled, cannot be built again from its own"):
        result = tune_micro_batch(model, Scaled(given.dataset, 2.0, batch_size=4), step,
                                  candidates=[4, 8], measure=fake_measure(SECONDS)[0])  # fmt: skip
    assert type(result.dataloader) is DataLoader
    assert result.dataloader.batch_size == 8


def test_nothing_the_tuner_did_shows_in_training() -> None:
    """Same seed, same loader: the run with the tuner (choosing the loader's own size)
    trains exactly as the run without it (its trial steps left no trace)."""
    plain, tuned = Losses(), Losses()

    def fit(callbacks: list[Any]) -> None:
        torch.manual_seed(11)
        loader = DataLoader(dataset(64), batch_size=8, shuffle=True)
        scheduler = AccumulationScheduler(target_global_batch=16, verbose=False)
        trainer(4, [scheduler, *callbacks]).fit(Net(), loader)

    fit([plain])
    measure, _ = fake_measure({2: 0.1, 4: 0.1, 8: 0.01, 16: 0.1})  # 8, as given
    fit([tuned, MicroBatchTuner(measure=measure, verbose=False)])
    assert tuned.losses == plain.losses
    for a, b in zip(tuned.batches, plain.batches, strict=True):
        assert torch.equal(a[0], b[0])


def test_a_resumed_run_keeps_the_checkpoints_choice() -> None:
    tuner = MicroBatchTuner(measure=fake_measure(SECONDS)[0], verbose=False)
    scheduler = AccumulationScheduler(target_global_batch=32, verbose=False)
    trainer(1, [tuner, scheduler]).fit(Net(), DataLoader(dataset(), batch_size=4))
    state = tuner.state_dict()
    assert state == {"batch_size": 8, "global_batch": 32}

    measure, ran = fake_measure({1: 9.0, 2: 9.0, 4: 9.0, 8: 9.0, 16: 0.001, 32: 9.0})
    resumed = MicroBatchTuner(measure=measure, verbose=False)
    resumed.load_state_dict(state)
    run = trainer(1, [resumed, AccumulationScheduler(target_global_batch=32, verbose=False)])
    run.fit(Net(), DataLoader(dataset(), batch_size=4))
    assert ran == []  # not timed again
    assert run.train_dataloader.batch_size == 8


def test_with_num_workers_tuner_the_workers_and_the_size_both_stay(tmp_path: Any) -> None:
    tuner = MicroBatchTuner(measure=fake_measure(SECONDS)[0], verbose=False)
    workers = NumWorkersTuner(max_workers=1, batches=2, warmup_batches=1, progress=False,
                              cache=False, verdict_steps=0)  # fmt: skip
    for order in ([tuner, workers], [workers, tuner]):
        run = trainer(1, [*order, AccumulationScheduler(target_global_batch=32, verbose=False)])
        run.fit(Net(), DataLoader(dataset(), batch_size=4))
        assert workers.result is not None
        assert run.train_dataloader.batch_size == 8
        assert run.train_dataloader.num_workers == workers.result.best["num_workers"]


def test_a_validation_interval_of_a_whole_epoch_stays_one_epoch() -> None:
    """36 samples in 5 batches of 8 (the last short), validated every 5: at micro-batches
    of 4 that is 10, one more than the epoch's 9 batches, which Lightning refuses."""
    measure, _ = fake_measure({4: 0.01, 8: 0.04})  # 4 is the fastest
    tuner = MicroBatchTuner([4, 8], measure=measure, verbose=False)
    scheduler = AccumulationScheduler(target_global_batch=8, verbose=False)
    counts = Counts()
    run = trainer(-1, [scheduler, tuner, counts], max_epochs=1, val_check_interval=5,
                  limit_val_batches=1)  # fmt: skip
    run.fit(Seen(), DataLoader(dataset(36), batch_size=8), DataLoader(dataset(8), batch_size=4))
    assert counts.val_every == 9


class Stateful(Scaled):
    """A loader Lightning resumes mid-epoch (it has a state_dict), not built again."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_a_stateful_loader_rebuilt_says_a_mid_epoch_resume_is_lost() -> None:
    model, given, step = _setup()
    stateful = Stateful(given.dataset, 2.0, batch_size=4)
    with pytest.warns(UserWarning, match="its `state_dict` included: a run resumed from a mid"):
        tune_micro_batch(model, stateful, step, candidates=[4, 8],
                         measure=fake_measure({4: 0.04, 8: 0.02})[0])  # fmt: skip


class Factor(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.accumulation = trainer.accumulate_grad_batches


def test_the_trainers_factor_is_the_new_micro_batches_when_training_starts() -> None:
    """Lightning reads it at a resume, before the first window, to tell a mid-window stop."""
    measure, _ = fake_measure({4: 0.04, 8: 0.02, 16: 0.08})  # 8 is the fastest
    tuner = MicroBatchTuner([4, 8, 16], measure=measure, verbose=False)
    scheduler = AccumulationScheduler(target_global_batch=16, verbose=False)
    factor = Factor()
    run = trainer(2, [scheduler, tuner, factor])
    run.fit(Seen(), DataLoader(dataset(64), batch_size=4))
    assert factor.accumulation == 2  # 2 of 8, not the 4 of 4 that setup counted


class Curriculum(Seen):
    """A ``train_dataloader()`` hook that gives other data each epoch (inputs shifted by
    100 x the epoch), reloaded every epoch by ``reload_dataloaders_every_n_epochs=1``."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_epochs: list[int] = []
        self.shifts: list[int] = []

    def train_dataloader(self) -> DataLoader[Any]:
        epoch = self.trainer.current_epoch
        self.hook_epochs.append(epoch)
        x, y = dataset(32).tensors
        return DataLoader(TensorDataset(x + 100 * epoch, y), batch_size=4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.shifts.append(round(float(batch[0].mean()) / 100))
        return super().training_step(batch, batch_idx)


class EpochLoaders(L.Callback):
    """The batch size and workers of the loader each epoch trains from."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        loader = trainer.train_dataloader
        self.seen.append((loader.batch_size, loader.num_workers))


def test_reloaded_loaders_come_from_the_hook_at_the_tuned_size() -> None:
    measure, _ = fake_measure({4: 0.04, 8: 0.02, 16: 0.08})  # 8 is the fastest
    tuner = MicroBatchTuner([4, 8, 16], measure=measure, verbose=False)
    scheduler = AccumulationScheduler(target_global_batch=16, verbose=False)
    epochs, model = EpochLoaders(), Curriculum()
    run = trainer(-1, [scheduler, tuner, epochs], max_epochs=3,
                  reload_dataloaders_every_n_epochs=1)  # fmt: skip
    run.fit(model)
    assert model.hook_epochs == [0, 1, 2]  # once per epoch, as without the tuner
    assert epochs.seen == [(8, 0)] * 3
    assert model.shifts == [0] * 4 + [1] * 4 + [2] * 4  # each epoch its own data, in 4 x 8
    assert model.sizes == [8] * 12  # the three trial steps left no entry
    assert run.global_step == 6  # 2 steps of 16 samples an epoch


def test_with_num_workers_tuner_reloaded_loaders_keep_both() -> None:
    tuner = MicroBatchTuner([4, 8, 16], measure=fake_measure(SECONDS)[0], verbose=False)
    workers = NumWorkersTuner(max_workers=1, batches=2, warmup_batches=1, progress=False,
                              cache=False, verdict_steps=0)  # fmt: skip
    for order in ([tuner, workers], [workers, tuner]):
        epochs, model = EpochLoaders(), Curriculum()
        scheduler = AccumulationScheduler(target_global_batch=16, verbose=False)
        run = trainer(-1, [*order, scheduler, epochs], max_epochs=2,
                      reload_dataloaders_every_n_epochs=1)  # fmt: skip
        run.fit(model)
        assert workers.result is not None
        best = workers.result.best["num_workers"]
        assert epochs.seen == [(8, best)] * 2
        assert model.shifts[-8:] == [0] * 4 + [1] * 4


class FailsInEpoch1(Seen):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.current_epoch == 1:
            raise RuntimeError("stopped")
        return super().training_step(batch, batch_idx)


def test_after_a_fit_that_raised_the_next_fit_trains_on_its_own_loader() -> None:
    tuner = MicroBatchTuner([4, 8], measure=fake_measure(SECONDS)[0], verbose=False)
    scheduler = AccumulationScheduler(target_global_batch=16, verbose=False)
    run = trainer(-1, [scheduler, tuner], max_epochs=2)
    with pytest.raises(RuntimeError, match="stopped"):
        run.fit(FailsInEpoch1(), DataLoader(dataset(32), batch_size=4))
    run.callbacks.remove(tuner)  # type: ignore[attr-defined]
    run.callbacks.remove(scheduler)  # type: ignore[attr-defined]
    model = Seen()
    run.fit(model, DataLoader(dataset(32), batch_size=4))
    assert model.sizes == [4] * 8  # the loader given (the epoch left), not the tuned size


class Counts(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.limit, self.val_every = trainer.limit_train_batches, trainer.val_check_batch


def test_trainer_counts_of_batches_keep_their_samples() -> None:
    measure, _ = fake_measure({4: 0.04, 8: 0.02, 16: 0.08})  # 8 is the fastest
    tuner = MicroBatchTuner([4, 8, 16], measure=measure, verbose=False)
    scheduler = AccumulationScheduler(target_global_batch=16, verbose=False)
    counts, model = Counts(), Seen()
    run = trainer(-1, [scheduler, tuner, counts], max_epochs=2, limit_train_batches=8,
                  val_check_interval=6)  # fmt: skip
    run.fit(model, DataLoader(dataset(64), batch_size=4))
    # 8 batches of 4 an epoch (2 optimizer steps of 16): 4 micro-batches of 8, still 2 steps
    assert (counts.limit, counts.val_every) == (4, 3)  # 6 x 4 samples = 3 x 8
    assert model.sizes == [8] * 8  # the three trial steps left no entry
    assert run.global_step == 4
    assert (run.limit_train_batches, run.val_check_interval) == (8, 6)  # the user's, after


@pytest.mark.gpu
def test_memory_limit_on_cuda_is_within_the_device() -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    limit = memory_limit("cuda", memory_headroom=0.1, reserve_bytes=2**20)
    assert limit is not None
    assert 0 < limit < total
    # Activations of 12, 100 and 400 MB: a first CUDA step's own allocations (the math
    # libraries' workspaces, about 20 MB on an H200) must not decide the order. With
    # nn.Linear(256, 256) at 8, 64 and 512 rows (KBs of activations) they did: the
    # smallest size read the largest peak there (2026-11-29).
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    data = TensorDataset(torch.randn(8192, 1024))
    loader = DataLoader(data, batch_size=256)
    result = tune_micro_batch(model, loader, lambda b: model(b[0]).square().mean(),
                              candidates=[256, 2048, 8192])  # fmt: skip
    peaks = [row["peak_bytes"] for row in result.table]
    assert all(p is not None for p in peaks)
    assert peaks == sorted(peaks)


class StatefulData(Net):
    """Net whose train loader is torchdata's StatefulDataLoader, made in the hook."""

    def train_dataloader(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(dataset(64), batch_size=4, shuffle=True,
                                  generator=torch.Generator().manual_seed(2))  # fmt: skip


def test_a_stateful_dataloader_at_the_new_size_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    """Kept a StatefulDataLoader, the tuned loader's state goes into the checkpoint."""
    pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata (test extra)")

    def fit(steps: int, ckpt: Path | None = None, every: int | None = None) -> Losses:
        seen = Losses()
        tuner = MicroBatchTuner([4, 8], measure=fake_measure({4: 0.04, 8: 0.02})[0],
                                verbose=False)  # fmt: skip
        scheduler = AccumulationScheduler(target_global_batch=16, verbose=False)
        saving = [ModelCheckpoint(tmp_path, every_n_train_steps=every, save_top_k=-1)]
        run = trainer(steps, [scheduler, tuner, seen, *(saving if every else [])],
                      enable_checkpointing=every is not None)  # fmt: skip
        run.fit(StatefulData(), ckpt_path=ckpt)
        assert type(run.train_dataloader).__name__ == "StatefulDataLoader"
        assert run.train_dataloader.batch_size == 8  # type: ignore[union-attr]
        return seen

    whole = fit(8)  # two epochs of 4 steps of 2 micro-batches of 8
    fit(6, every=6)  # stops, and saves, halfway through the second epoch
    resumed = fit(8, ckpt=tmp_path / "epoch=1-step=6.ckpt")
    assert len(whole.batches) == 16
    assert len(resumed.batches) == 4  # the epoch's last 2 steps, not the whole epoch again
    for got, expected in zip(resumed.batches, whole.batches[12:], strict=True):
        assert torch.equal(got[0], expected[0])
    assert resumed.losses == whole.losses[12:]


# --- what a new user found (no batches, no parameters, manual optimization, no batch size) ----


def test_with_no_training_batches_nothing_is_tuned_and_nothing_trains() -> None:
    measure, ran = fake_measure(SECONDS)
    tuner = MicroBatchTuner(measure=measure, verbose=False)
    scheduler = AccumulationScheduler(target_global_batch=32, verbose=False)
    model = Net()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    run = trainer(-1, [scheduler, tuner], max_epochs=1, limit_train_batches=0)
    run.fit(model, DataLoader(dataset(), batch_size=4))
    assert ran == []  # no trial step either
    assert tuner.result is None
    assert run.global_step == 0
    assert run.optimizers[0].state == {}  # AdamW made no moments: no step ran
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name  # bit-identical
        assert p.grad is None
    assert run.limit_train_batches == 0  # the user's count, not one batch


def test_a_zero_count_of_batches_stays_zero_at_a_new_micro_batch() -> None:
    """``val_check_interval`` and ``limit_train_batches`` in batches: 0 is none at any size."""
    tuner = MicroBatchTuner(measure=fake_measure(SECONDS)[0], verbose=False)
    run = trainer(1, [], limit_train_batches=0)
    tuner._count_in_new_batches(run, given=4, best=8, batches=16)
    assert run.limit_train_batches == 0  # it said 1: one step trained
    run = trainer(1, [], limit_train_batches=6)
    tuner._counts = None
    tuner._count_in_new_batches(run, given=4, best=8, batches=16)
    assert run.limit_train_batches == 3


class Constant(L.LightningModule):
    """A LightningModule with no parameters at all."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return batch[0].sum()

    def configure_optimizers(self) -> None:
        return None


def test_a_model_without_parameters_is_refused_with_the_reason() -> None:
    step = lambda batch: batch[0].sum()  # noqa: E731
    loader = DataLoader(dataset(16), batch_size=4)
    with pytest.raises(SpeedkitConfigError) as error:
        tune_micro_batch(nn.Identity(), loader, step, measure=fake_measure(SECONDS)[0])
    message = str(error.value)
    assert message.startswith("`model` has no parameters that require grad")
    assert "got Identity()" in message
    frozen = nn.Linear(16, 1).requires_grad_(False)
    with pytest.raises(SpeedkitConfigError, match="`model` has no parameters that require grad"):
        tune_micro_batch(frozen, loader, step, measure=fake_measure(SECONDS)[0])
    tuner = MicroBatchTuner(measure=fake_measure(SECONDS)[0], verbose=False)
    scheduler = AccumulationScheduler(target_global_batch=16, verbose=False)
    with pytest.raises(SpeedkitConfigError, match="`model` has no parameters that require grad"):
        trainer(1, [scheduler, tuner]).fit(Constant(), loader)


class Manual(Net):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizer.step()  # type: ignore[union-attr]
        optimizer.zero_grad()  # type: ignore[union-attr]
        return loss


def test_manual_optimization_is_told_to_accumulate_by_hand_not_to_add_a_scheduler() -> None:
    tuner = MicroBatchTuner(measure=fake_measure(SECONDS)[0], verbose=False)
    with pytest.raises(SpeedkitConfigError) as error:
        trainer(1, [tuner]).fit(Manual(), DataLoader(dataset(), batch_size=4))
    message = str(error.value)
    assert "`automatic_optimization = False`" in message
    assert "`training_step` accumulates gradients by hand" in message
    assert "tune_micro_batch(" in message  # the function works without the callback
    assert "Add `AccumulationScheduler" not in message  # which refuses manual optimization
    # with the scheduler listed after it, the tuner's message comes first, and says the same
    scheduler = AccumulationScheduler(target_global_batch=16, verbose=False)
    with pytest.raises(SpeedkitConfigError, match="MicroBatchTuner cannot keep the global"):
        trainer(1, [tuner, scheduler]).fit(Manual(), DataLoader(dataset(), batch_size=4))


def test_a_loader_without_a_batch_size_says_so_not_nonetype() -> None:
    unbatched = DataLoader(dataset(16), batch_size=None)  # the dataset's items are the batches
    model, _, step = _setup()
    with pytest.raises(SpeedkitConfigError) as error:
        tune_micro_batch(model, unbatched, step, measure=fake_measure(SECONDS)[0])
    assert "`batch_size=None`" in str(error.value)
    assert "NoneType" not in str(error.value)
    tuner = MicroBatchTuner(measure=fake_measure(SECONDS)[0], verbose=False)
    scheduler = AccumulationScheduler(target_global_batch=16, verbose=False)
    with pytest.raises(SpeedkitConfigError) as error:
        trainer(1, [scheduler, tuner]).fit(Net(), unbatched)
    message = str(error.value)
    assert "NoneType" not in message
    assert "`batch_size=None`" in message
    assert "each item the dataset gives is a whole batch" in message
    assert "give the loader a `batch_size`" in message  # the fix
    # a batch sampler of the user's is still named
    bucketed = DataLoader(dataset(16), batch_sampler=LengthBucketBatchSampler([1] * 16, 4))
    with pytest.raises(SpeedkitConfigError, match="batches with LengthBucketBatchSampler"):
        trainer(1, [scheduler, tuner]).fit(Net(), bucketed)


class _Normed(Net):
    """Net with a batch norm layer trained in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)  # over the 4 tokens of each sample

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(self.norm(x)), y)


def test_a_new_micro_batch_under_batch_norm_is_said_with_the_fix() -> None:
    """The global batch stays, but batch norm normalises by each micro-batch: a new user's
    BatchNorm CNN went from 16 to 8 with nothing said."""
    scheduler = AccumulationScheduler(target_global_batch=32, micro_batch_size=4, verbose=False)
    tuner = MicroBatchTuner(measure=fake_measure(SECONDS)[0], verbose=False)
    said = (
        r"micro-batches of 8 \(the loader gives 4\): the batch norm layers `norm` normalise "
        r".* `MicroBatchTuner\(candidates=\[4\]\)`"
    )
    with pytest.warns(UserWarning, match=said):
        trainer(1, [scheduler, tuner]).fit(_Normed(), DataLoader(dataset(96), batch_size=4))
    kept = MicroBatchTuner([4], measure=fake_measure(SECONDS)[0], verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the loader's own size: nothing to say
        trainer(1, [AccumulationScheduler(target_global_batch=32, verbose=False), kept]).fit(
            _Normed(), DataLoader(dataset(96), batch_size=4)
        )
    assert not [w for w in caught if "batch norm" in str(w.message)]
