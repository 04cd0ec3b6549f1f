"""CompileWatch driven by hand: dynamo's callback arguments and a clock given by the test."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_speedkit.compute import CompileWatch as FromCompute
from lightning_speedkit.compute.regional_compile import CompileWatch as FromRegionalCompile
from lightning_speedkit.measure import _compile_watch
from lightning_speedkit.measure._compile_watch import CompileWatch, _frame_and_attempt


class Clock:
    """Seconds that advance only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _args(compile_id: str, trigger: str = "DYNAMO") -> Any:
    """What torch passes to a compile callback: the trigger and the compile id."""
    return SimpleNamespace(callback_trigger=SimpleNamespace(name=trigger), compile_id=compile_id)


def _compile(watch: CompileWatch, clock: Clock, compile_id: str, seconds: float, **kw: Any) -> None:
    watch._start(_args(compile_id, **kw))
    clock.now += seconds
    watch._end(_args(compile_id, **kw))


def test_the_old_import_paths_name_the_same_class() -> None:
    assert FromCompute is CompileWatch
    assert FromRegionalCompile is CompileWatch


@pytest.mark.parametrize(
    ("compile_id", "expected"),
    [("0/0", ("0", 0)), ("3/2", ("3", 2)), ("!1/4_1", ("1", 4)), ("7/x", ("7", 0)), ("", ("", 0))],
)
def test_a_compile_id_names_its_frame_and_attempt(compile_id: str, expected: tuple) -> None:
    assert _frame_and_attempt(compile_id) == expected


def test_graphs_recompiles_and_seconds_add_up_by_the_clock_given() -> None:
    clock = Clock()
    watch = CompileWatch(clock=clock)
    _compile(watch, clock, "0/0", 1.5)
    _compile(watch, clock, "0/1", 0.25)
    _compile(watch, clock, "1/0", 0.5)
    _compile(watch, clock, "0/1", 0.125, trigger="LAZY_BACKWARD")  # a backward graph: time only
    _compile(watch, clock, "0/2", 0.125)
    assert (watch.graphs, watch.recompiles, watch.seconds) == (4, 2, 2.5)
    assert watch.compilations == 5
    assert watch.snapshot() == (4, 2, 2.5)
    assert dict(watch.by_frame) == {"0": 2}
    assert watch.most_recompiled == 2


def test_a_frame_first_compiled_before_the_watch_counts_as_a_graph_not_a_recompile() -> None:
    clock = Clock()
    watch = CompileWatch(clock=clock)
    _compile(watch, clock, "5/3", 1.0)  # its attempts 0 to 2 happened in an earlier fit
    _compile(watch, clock, "5/4", 1.0)
    assert (watch.graphs, watch.recompiles) == (2, 1)
    assert watch.by_frame["5"] == 4  # dynamo's own count, which its recompile limit reads


def test_the_last_reason_is_dynamos_for_the_frame_that_recompiled_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock()
    watch = CompileWatch(clock=clock)
    assert watch.last_reason() is None  # nothing recompiled
    for compile_id in ("0/0", "0/1", "1/0", "1/1", "1/2"):
        _compile(watch, clock, compile_id, 0.0)
    reasons = [("0/1", "x changed"), ("1/1", "size mismatch at index 0"),
               ("1/2", "size mismatch at index 1")]  # fmt: skip
    monkeypatch.setattr(_compile_watch._compat, "dynamo_recompile_reasons", lambda: reasons)
    assert watch.last_reason() == "size mismatch at index 1"
    monkeypatch.setattr(_compile_watch._compat, "dynamo_recompile_reasons", lambda: reasons[:2])
    assert watch.last_reason() is None  # dynamo no longer records frame 1's last one


def test_installed_it_counts_what_torch_compiles_and_removed_it_stops() -> None:
    clock = Clock()
    watch = CompileWatch(clock=clock).install()
    assert watch.install() is watch  # installing twice registers once
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    double(torch.ones(2))
    double(torch.ones(3))
    watch.remove()
    watch.remove()
    double(torch.ones(4))
    assert (watch.graphs, watch.recompiles, watch.compilations) == (2, 1, 2)
    assert watch.seconds == 0.0  # the clock given never moved
