"""CompileHold: a due window waits until a whole step compiles nothing."""

from __future__ import annotations

from lightning_speedkit.measure._profiler_hold import CompileHold


class Watch:
    """Counts compilations as a test says; records install and remove."""

    def __init__(self) -> None:
        self.compilations = 0
        self.calls: list[str] = []

    def install(self) -> Watch:
        self.calls.append("install")
        return self

    def remove(self) -> None:
        self.calls.append("remove")


def test_a_compiled_model_is_held_until_a_step_compiles_nothing() -> None:
    watch = Watch()
    watch.compilations = 4  # before the fit: not this fit's
    hold = CompileHold(watch)
    hold.begin(compiled_parts=True)
    held = []
    for compiled in (2, 1, 0, 3):  # a recompile after release does not hold again
        watch.compilations += compiled
        hold.step_ends()
        held.append(hold.held)
    assert held == [True, True, False, False]
    hold.end()
    assert watch.calls == ["install", "remove"]


def test_an_uncompiled_model_is_never_held() -> None:
    watch = Watch()
    hold = CompileHold(watch)
    hold.begin(compiled_parts=False)
    watch.compilations = 5
    hold.step_ends()
    assert hold.held is False


def test_a_window_counts_its_compilations_from_its_start() -> None:
    watch = Watch()
    hold = CompileHold(watch)
    hold.begin(compiled_parts=False)
    watch.compilations = 7  # outside the window, not held: not counted
    hold.window_begins()
    watch.compilations = 9
    assert hold.compiled_in_step() == 2
    assert hold.compiled_in_step() == 0
