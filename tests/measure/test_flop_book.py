"""FLOP bookkeeping on its own: which step is counted, and FLOPs per batch shape."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_speedkit import SpeedkitConfigError, _surgery, count_flops
from lightning_speedkit.measure._batch_info import BatchInfo
from lightning_speedkit.measure._flop_book import (
    PROFILED_SKIPS,
    Counted,
    CountSchedule,
    FlopBook,
    step_flops,
)


def _info(rows: int, tokens: int | None = None) -> BatchInfo:
    return BatchInfo(signature=(((rows, 8), "float32"),), samples=rows, tokens=tokens)


class _Compiles:
    """A compile watch whose count the test moves."""

    def __init__(self) -> None:
        self.compilations = 0
        self.removed = False

    def remove(self) -> None:
        self.removed = True


def _matmul(rows: int) -> None:
    torch.ones(rows, 8) @ torch.ones(8, 4)  # 2 * rows * 8 * 4 FLOPs


def test_a_shape_is_counted_once_and_its_count_is_exact() -> None:
    book = FlopBook()
    schedule = CountSchedule(book, max_counts=8, profiling=lambda: False)
    for _ in range(2):
        schedule.step_start(_info(2))
        _matmul(2)
        schedule.step_end(_info(2))
    assert book.counted == {_info(2).key: Counted(2, None, 128.0, 128.0)}
    schedule.step_start(_info(2))
    assert not schedule.counting  # known already


def test_no_more_shapes_than_max_counts_are_counted() -> None:
    schedule = CountSchedule(FlopBook(), max_counts=1, profiling=lambda: False)
    counted = []
    for rows in (1, 2):
        schedule.step_start(_info(rows))
        counted.append(schedule.step_end(_info(rows)))
    assert counted == [True, False]


def test_compiled_parts_are_counted_only_after_a_step_that_compiled_nothing() -> None:
    compiles = _Compiles()
    schedule = CountSchedule(FlopBook(), max_counts=8, profiling=lambda: False)
    schedule.watch(compiles)
    counted = []
    for compiled in (2, 1, 0, 0):  # what each step compiles
        schedule.step_start(_info(4))
        counted.append(schedule.counting)
        compiles.compilations += compiled
        schedule.step_end(_info(4))
    assert counted == [False, False, False, True]
    assert not compiles.removed  # watched to the fit's end: a later step may compile
    schedule.close()
    assert compiles.removed


def test_a_step_that_compiles_is_untimed_at_any_step() -> None:
    """A recompilation after the first count (a new shape, a guard failing when a hook
    comes off a compiled block) took a second in a step SpeedMonitor timed: a short run's
    summary was that one step. The watch stayed only until the first settled step."""
    compiles = _Compiles()
    schedule = CountSchedule(FlopBook(), max_counts=1, profiling=lambda: False)
    schedule.watch(compiles)
    untimed = []
    for compiled in (2, 0, 0, 0, 1, 0):  # step 3 counted; step 5 recompiles
        schedule.step_start(_info(4))
        compiles.compilations += compiled
        untimed.append(schedule.untimed)
        schedule.step_end(_info(4))
    assert untimed == [True, False, True, False, True, False]


def test_a_step_in_which_the_kit_did_one_time_work_is_counted_again() -> None:
    """A swap's parity check (or attention found by tracing) runs in the first step, with
    checkpoints paused: its count would miss the recomputation later steps do."""
    book = FlopBook()
    schedule = CountSchedule(book, max_counts=8, profiling=lambda: False)
    schedule.step_start(_info(2))
    _matmul(2)
    _surgery.note_first_call_work()
    assert schedule.step_end(_info(2)) is False
    assert book.counted == {}
    schedule.step_start(_info(2))
    assert schedule.counting  # the next step of the shape is counted instead
    _matmul(2)
    _matmul(2)  # e.g. the recomputation the first step did not do
    assert schedule.step_end(_info(2)) is True
    assert book.counted == {_info(2).key: Counted(2, None, 256.0, 256.0)}


def test_one_time_work_that_never_ends_still_leaves_a_count() -> None:
    book = FlopBook()
    schedule = CountSchedule(book, max_counts=8, profiling=lambda: False)
    for _ in range(PROFILED_SKIPS + 1):
        schedule.step_start(_info(2))
        _surgery.note_first_call_work()
        schedule.step_end(_info(2))
    assert _info(2).key in book.counted


def test_a_profiled_step_waits_up_to_the_limit() -> None:
    profiling = [True] * (PROFILED_SKIPS + 1)
    schedule = CountSchedule(FlopBook(), max_counts=8, profiling=lambda: profiling.pop())
    waited = 0
    while not schedule.counts("shape"):
        waited += 1
    assert waited == PROFILED_SKIPS  # then counts under the profiler


def test_a_count_cut_off_is_dropped_and_leaves_no_counter_behind() -> None:
    book = FlopBook()
    schedule = CountSchedule(book, max_counts=8, profiling=lambda: False)
    schedule.step_start(_info(2))
    schedule.drop()
    assert not schedule.counting
    assert book.counted == {}
    assert not torch._C._is_torch_function_mode_enabled()
    assert torch._C._len_torch_dispatch_stack() == 0


def test_an_attention_models_counts_are_extrapolated_on_their_parabola() -> None:
    """A transformer's FLOPs grow with the square of the sequence (attention): a line
    fitted to the counts at 8..64 tokens a sample read the 256-token batch 60% low.
    Counts that lie on a parabola are extrapolated on it, to the FLOP."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    samples = 2

    def counted(length: int) -> float:
        x = torch.randn(samples, length, 16, requires_grad=True)
        return float(count_flops(lambda: layer(x).sum().backward()).total)

    book = FlopBook()
    for length in (8, 16, 32, 48, 64):
        flops = counted(length)
        book.add(f"t{length}", Counted(samples, samples * length, flops, flops))
    model, _ = book.for_batch(_info(samples, tokens=samples * 256)) or (0.0, 0.0)
    assert model == pytest.approx(counted(256), rel=1e-9)


def test_counts_on_no_parabola_are_fitted_by_a_line() -> None:
    """Padded batches: FLOPs follow the padded length, not the real tokens, so the counts
    lie on no curve in tokens; the estimate is the least-squares line."""
    book = FlopBook()
    for tokens, flops in ((10, 100.0), (20, 260.0), (30, 270.0), (40, 410.0)):
        book.add(f"t{tokens}", Counted(1, tokens, flops, flops))
    # least squares: slope 4700 / 500 = 9.4 through the means (25, 260): 25 + 9.4 * 50
    assert book.for_batch(_info(1, tokens=50)) == pytest.approx((495.0, 495.0))


def test_estimates_fit_a_line_in_tokens_or_scale_the_closest_count() -> None:
    book = FlopBook()
    for tokens in (40, 80):
        book.add(f"t{tokens}", Counted(4, tokens, 1000 + 10 * tokens, 2000 + 10 * tokens))
    assert book.for_batch(_info(4, tokens=60)) == (1600.0, 2600.0)  # on the line
    assert book.for_batch(_info(8, tokens=None)) == (2800.0, 4800.0)  # twice the 40-token one
    assert book.for_batch(_info(2, tokens=20)) == (700.0, 1200.0)  # by tokens, from 40
    assert FlopBook().for_batch(_info(4)) is None


def test_the_book_round_trips_through_a_checkpoint() -> None:
    book = FlopBook()
    book.add("a", Counted(4, 16, 100.0, 120.0))
    state = book.state_dict()
    assert state == {"a": {"samples": 4, "tokens": 16, "model": 100.0, "hardware": 120.0}}
    restored = FlopBook()
    restored.add("b", Counted(1, None, 1.0, 1.0))
    restored.load_state_dict(state)
    assert restored.counted == book.counted


def test_the_users_flops_per_batch_counts_for_model_and_hardware() -> None:
    book = FlopBook()
    book.add(_info(4).key, Counted(4, None, 10.0, 12.0))
    assert step_flops(_info(4), "batch", book, None) == (10.0, 12.0)
    assert step_flops(_info(4), "batch", book, lambda b: 7) == (7.0, 7.0)
    bad: Any = lambda b: "seven"  # noqa: E731
    with pytest.raises(SpeedkitConfigError, match="`flops_per_batch` must return"):
        step_flops(_info(4), "batch", book, bad)
