"""HangWatchdog: the limit, the dumps, the late rank named, recovery, abort, the thread's life.

The timing logic runs on an injected clock and a dict standing in for the rendezvous
store, with exact expected values; two gloo processes check the whole thing for real.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch

from lightning_speedkit import HangWatchdog, SpeedkitConfigError
from lightning_speedkit.distributed.hang_watchdog import (
    HANG_EXIT_CODE,
    PHASES,
    HangEvent,
    RankProgress,
    late_ranks,
)

from ..helpers.models import MLP, loader
from ..helpers.multiprocess import run_script, run_script_failing


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class DictStore:
    """The four store calls the watchdog makes, on a dict shared by the simulated ranks."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.lock = threading.Lock()

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            self.data[key] = self.data.get(key, 0) + amount
            return int(self.data[key])

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        with self.lock:
            return bytes(self.data[key])

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(key in self.data for key in keys)


class Rank:
    """A watchdog driven by hand: its hooks at given clock times, its thread's looks."""

    def __init__(self, watchdog: HangWatchdog, clock: Clock, rank: int = 0) -> None:
        self.w, self.clock, self.rank = watchdog, clock, rank
        self.trainer = SimpleNamespace(global_step=0)
        self.exits: list[int] = []
        watchdog._clock = clock
        watchdog._exit = self.exits.append

    def start(self) -> None:
        self.w.on_train_batch_start(self.trainer, None, None, 0)  # type: ignore[arg-type]

    def phase(self, hook: str) -> None:
        args = {"on_before_backward": (torch.zeros(()),), "on_before_optimizer_step": (None,)}
        getattr(self.w, hook)(self.trainer, None, *args.get(hook, ()))

    def end(self) -> None:
        self.w.on_train_batch_end(self.trainer, None, None, None, 0)  # type: ignore[arg-type]
        self.trainer.global_step += 1

    def step(self, seconds: float) -> None:
        """A whole step of ``seconds``, the thread looking at its end."""
        self.start()
        self.clock.now += seconds
        self.end()
        self.w._tick(self.clock.now)

    def look(self, after: float = 0.0) -> list[HangEvent]:
        """Advance the clock, let the thread look once, return the events it added."""
        self.clock.now += after
        before = len(self.w.events)
        self.w._tick(self.clock.now)
        return self.w.events[before:]


def ranks(tmp_path: Path, world: int, **kwargs: Any) -> tuple[list[Rank], DictStore, Clock]:
    clock, store = Clock(), DictStore()
    out = []
    for r in range(world):
        watchdog = HangWatchdog(dirpath=tmp_path, **kwargs)
        watchdog._rank, watchdog._world_size, watchdog._dir = r, world, tmp_path
        watchdog._store = store if world > 1 else None
        out.append(Rank(watchdog, clock, r))
    return out, store, clock


# --- the limit --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "steps", "expected"),
    [
        # no median yet (fewer than 5 steps): factor x min_timeout
        ({}, [], 600.0),
        ({}, [300.0, 1, 1, 1], 600.0),
        ({"factor": 4, "min_timeout": 30}, [], 120.0),
        # from the fifth completed step: max(min_timeout, factor x median)
        ({}, [300.0, 1, 1, 1, 1], 60.0),
        ({}, [300.0, 8, 9, 7, 8], 80.0),
        ({"min_timeout": 1.0}, [1.0, 2.0, 3.0, 100.0, 5.0], 30.0),
        ({"min_timeout": 1.0, "factor": 2.5}, [1.0, 2.0, 3.0, 100.0, 5.0, 4.0], 8.75),
        # a fixed timeout from the first step on, whatever the steps
        ({"timeout": 30}, [], 30.0),
        ({"timeout": 30}, [1, 1, 1, 1, 1, 1], 30.0),
    ],
)
def test_threshold(tmp_path: Path, kwargs: dict[str, Any], steps: list[float],
                   expected: float) -> None:  # fmt: skip
    (rank,), _, _ = ranks(tmp_path, 1, **kwargs)
    for seconds in steps:
        rank.step(seconds)
    assert rank.w.threshold() == expected
    assert rank.w.events == []


def test_slow_first_step_is_no_alarm_and_a_hang_after_it_is(tmp_path: Path) -> None:
    (rank,), _, _ = ranks(tmp_path, 1)  # factor 10, min_timeout 60
    rank.start()  # the first step compiles for 5 minutes
    assert rank.look(after=61) == []
    assert rank.look(after=239) == []  # 300 s in: below 10 x 60
    rank.end()
    for _ in range(5):
        rank.step(1.0)
    assert rank.w.threshold() == 60.0  # median 1 s: the floor
    rank.start()
    assert rank.look(after=59) == []
    (event,) = rank.look(after=2)  # 61 s: past max(60, 10 x 1)
    assert (event.kind, event.batch, event.step, event.seconds, event.threshold) == (
        "overrun", 7, 6, 61.0, 60.0,
    )  # fmt: skip
    assert event.path == str(tmp_path / "hang-rank0.txt")
    assert Path(event.path).is_file()


def test_a_first_step_that_never_ends_is_caught(tmp_path: Path) -> None:
    (rank,), _, _ = ranks(tmp_path, 1)
    rank.start()
    assert rank.look(after=600) == []  # exactly at the warm-up limit: not past it
    (event,) = rank.look(after=0.5)
    assert (event.kind, event.batch, event.seconds, event.threshold) == (
        "overrun", 1, 600.5, 600.0,
    )  # fmt: skip


def test_recovered_slow_step_is_reported_once(tmp_path: Path) -> None:
    (rank,), _, _ = ranks(tmp_path, 1, timeout=10)
    for _ in range(3):
        rank.step(1.0)
    rank.start()
    (overrun,) = rank.look(after=11)
    first_dump = Path(overrun.path or "").stat().st_mtime_ns
    for _ in range(5):  # still in the same step: nothing new, no second dump
        assert rank.look(after=10) == []
    assert Path(overrun.path or "").stat().st_mtime_ns == first_dump
    rank.clock.now += 4  # it ends 65 s after it started
    rank.end()
    (recovered,) = rank.look(after=0.5)
    assert (recovered.kind, recovered.batch, recovered.seconds, recovered.threshold) == (
        "recovered", 4, 65.0, 10.0,
    )  # fmt: skip
    for _ in range(3):
        rank.step(1.0)
    assert rank.look(after=9) == []  # between steps, within the limit
    assert [e.kind for e in rank.w.events] == ["overrun", "recovered"]
    assert rank.exits == []  # action="dump" lets training go on


def test_recovery_seen_at_teardown(tmp_path: Path) -> None:
    """A slow step that ends right before the fit does is still reported as recovered."""
    (rank,), _, _ = ranks(tmp_path, 1, timeout=10)
    rank.start()
    rank.look(after=12)
    rank.clock.now += 1
    rank.end()
    rank.w._thread.start(lambda stop: None)
    rank.w._stop_thread()
    assert [(e.kind, e.seconds) for e in rank.w.events] == [("overrun", 12.0), ("recovered", 13.0)]


# --- the dump ---------------------------------------------------------------------------------


def parked_in_a_named_function(ready: threading.Event, release: threading.Event) -> None:
    ready.set()
    release.wait(30)


def test_dump_holds_every_thread_and_names_the_waiting_frame(tmp_path: Path) -> None:
    (rank,), _, _ = ranks(tmp_path, 1, timeout=5)
    ready, release = threading.Event(), threading.Event()
    parked = threading.Thread(target=parked_in_a_named_function, args=(ready, release),
                              name="parked")  # fmt: skip
    parked.start()
    ready.wait(10)
    events: list[HangEvent] = []
    try:
        rank.start()
        rank.phase("on_before_backward")
        # the dump is taken from another thread, as the watchdog's is, while this one waits
        looking = threading.Thread(target=lambda: events.extend(rank.look(after=7)))
        looking.start()
        looking.join()
    finally:
        release.set()
        parked.join()
    (event,) = events
    text = Path(event.path or "").read_text()
    assert "rank 0 of 1" in text
    assert "why: this rank's step ran 7.0 s, past its limit of 5.0 s" in text
    assert "where: rank 0: batch 1 (global step 0), backward for 7.0 s" in text
    readable, raw = text.split("--- faulthandler")
    # the readable part: the main thread first, the parked thread by name and function
    assert readable.index("Thread MainThread") < readable.index("Thread parked")
    assert "in parked_in_a_named_function" in readable
    assert "release.wait(30)" in readable  # the source line
    assert "in test_dump_holds_every_thread_and_names_the_waiting_frame" in readable
    # faulthandler's own dump, every thread
    assert "(most recent call first)" in raw
    assert "in parked_in_a_named_function" in raw
    assert not list(tmp_path.glob("*.partial"))


def test_dump_failure_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (rank,), _, _ = ranks(tmp_path, 1, timeout=5)
    rank.w._dir = blocker / "dumps"  # a directory that cannot be made
    rank.start()
    (event,) = rank.look(after=6)
    assert (event.kind, event.path) == ("overrun", None)
    assert "could not write" in caplog.text


def test_stacks_that_cannot_be_written_go_to_stderr(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """The directory was fine at setup and is gone at the hang (a file took its name): the
    stacks are the one thing the user needs from a hang, so they go to stderr instead."""
    (rank,), _, _ = ranks(tmp_path, 1, timeout=5)
    rank.w._dir = tmp_path / "dumps"
    (tmp_path / "dumps").write_text("")  # a file where the directory was
    rank.start()
    events: list[HangEvent] = []
    looking = threading.Thread(target=lambda: events.extend(rank.look(after=6)))
    looking.start()  # as the watchdog's thread: the main thread's stack is in the dump
    looking.join()
    (event,) = events
    assert (event.kind, event.path) == ("overrun", None)
    err = capsys.readouterr().err
    assert "HangWatchdog stack dump: rank 0 of 1" in err
    assert "why: this rank's step ran 6.0 s, past its limit of 5.0 s" in err
    assert "Thread MainThread" in err
    assert "in test_stacks_that_cannot_be_written_go_to_stderr" in err
    assert f"could not write {tmp_path / 'dumps' / 'hang-rank0.txt'}" in caplog.text
    assert "stacks printed to stderr" in caplog.text
    assert "written to None" not in caplog.text


@pytest.mark.parametrize("given", [True, False])
def test_a_directory_that_cannot_be_written_is_refused_at_setup(
    tmp_path: Path, given: bool
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    unwritable = blocker / "dumps"  # under a file: no one can make it, root included
    watchdog = HangWatchdog(timeout=5, dirpath=unwritable if given else None)
    trainer = SimpleNamespace(global_rank=0, world_size=1, default_root_dir=str(unwritable))
    with pytest.raises(SpeedkitConfigError) as error:
        watchdog.setup(trainer, None, "fit")  # type: ignore[arg-type]
    message = str(error.value)
    shown = f"'{unwritable}'" if given else f"None (the Trainer's default_root_dir, '{unwritable}')"
    assert message.startswith(f"`dirpath` must be a directory the stacks can be written to, "
                              f"got {shown}: ")  # fmt: skip
    assert "Not a directory" in message
    assert message.endswith("pass `dirpath=` a writable directory, on a cluster one every "
                            "node shares.")  # fmt: skip
    assert not watchdog.running


# --- several ranks: who is behind -------------------------------------------------------------


def progress(rank: int, batch: int, phase: str) -> RankProgress:
    return RankProgress(rank=rank, batch=batch, step=batch - 1, phase=phase, seconds=1.0)


@pytest.mark.parametrize(
    ("where", "behind"),
    [
        ([(12, "backward"), (12, "forward")], [1]),  # asleep in forward, the other in all-reduce
        ([(12, "backward"), (11, "between steps"), (12, "backward")], [1]),  # loading data
        ([(13, "forward"), (12, "after backward"), (12, "optimizer step")], [1, 2]),
        ([(12, "backward"), (12, "backward")], []),  # all in one collective: none by progress
        ([(3, "forward")], []),
    ],
)
def test_late_ranks(where: list[tuple[int, str]], behind: list[int]) -> None:
    found = late_ranks([progress(r, b, p) for r, (b, p) in enumerate(where)])
    assert [p.rank for p in found] == behind


def test_phases_are_in_step_order() -> None:
    assert PHASES == ("forward", "backward", "after backward", "optimizer step", "between steps",
                      "validating", "saving a checkpoint", "epoch end",
                      "paused by a kit callback")  # fmt: skip


def test_a_rank_stuck_after_its_step_is_caught_and_its_recovery_timed(tmp_path: Path) -> None:
    """Between steps is watched from the step's end: a batch-end callback's work, the
    next fetch. (Lightning 2.6's other ranks wait for it in the broadcast that starts
    every batch, between steps too: no step of theirs overruns.)"""
    (rank,), _, _ = ranks(tmp_path, 1, timeout=10)
    for _ in range(3):
        rank.step(1.0)
    assert rank.look(after=10) == []  # exactly at the limit: not past it
    (overrun,) = rank.look(after=0.5)
    assert (overrun.kind, overrun.batch, overrun.seconds, overrun.between) == (
        "overrun", 3, 10.5, True,
    )  # fmt: skip
    assert "has been between steps 10.5 s" in Path(overrun.path or "").read_text()
    assert rank.look(after=30) == []  # one overrun, one dump
    rank.start()  # the next batch begins 42.5 s after the last one ended
    (recovered,) = rank.look(after=0.5)
    assert (recovered.kind, recovered.batch, recovered.seconds, recovered.between) == (
        "recovered", 3, 40.5, True,
    )  # fmt: skip
    assert rank.exits == []


@pytest.mark.parametrize(
    ("hook", "args"),
    [("on_validation_start", ()), ("on_save_checkpoint", ({},)), ("on_train_epoch_end", ())],
)
def test_validation_saves_and_epoch_ends_are_not_watched(
    tmp_path: Path, hook: str, args: tuple[Any, ...]
) -> None:
    (rank,), _, _ = ranks(tmp_path, 1, timeout=10)
    rank.step(1.0)
    getattr(rank.w, hook)(rank.trainer, None, *args)
    assert rank.look(after=600) == []  # a long validation, save or epoch end: no alarm
    rank.start()
    assert rank.look(after=1) == []
    assert rank.w.events == []


def test_the_time_after_validation_is_watched_again(tmp_path: Path) -> None:
    (rank,), _, _ = ranks(tmp_path, 1, timeout=10)
    rank.step(1.0)
    rank.w.on_validation_start(rank.trainer, None)  # type: ignore[arg-type]
    rank.clock.now += 300
    rank.w.on_validation_end(rank.trainer, None)  # type: ignore[arg-type]
    assert rank.look(after=10) == []  # counted from validation's end
    (overrun,) = rank.look(after=1)
    assert (overrun.kind, overrun.seconds, overrun.between) == ("overrun", 11.0, True)


def test_two_ranks_sleeping_one_is_named(tmp_path: Path) -> None:
    """Rank 1 sleeps in its forward pass; rank 0 waits in the backward all-reduce."""
    (r0, r1), store, _ = ranks(tmp_path, 2, timeout=2)
    for r in (r0, r1):
        r.start()
    r0.clock.now += 0.5
    r0.phase("on_before_backward")  # rank 0 reaches the all-reduce 0.5 s into the step
    (own1,) = r1.look(after=2.0)  # rank 1's step: 2.5 s
    assert (own1.kind, own1.rank, own1.batch, own1.seconds) == ("overrun", 1, 1, 2.5)
    assert store.data["alarms"] == 1  # rank 1 raised the alarm
    events = r0.look()
    assert [e.kind for e in events] == ["overrun", "report"]
    report = events[1]
    assert report.behind == (RankProgress(1, 1, 0, "forward", 2.5),)
    assert report.progress == (RankProgress(0, 1, 0, "backward", 2.0),
                               RankProgress(1, 1, 0, "forward", 2.5))  # fmt: skip
    assert report.silent == ()
    text = (tmp_path / "hang-report.txt").read_text()
    assert "rank 1: batch 1 (global step 0), forward for 2.5 s   <- behind" in text
    assert "Behind: rank 1 (batch 1, forward)." in text
    for r in (0, 1):
        assert (tmp_path / f"hang-rank{r}.txt").is_file()
    # rank 1 sees its own alarm and rank 0's: no second dump, no event
    assert r1.look(after=1.0) == []
    assert r0.look(after=1.0) == []


def test_rank_outside_its_step_dumps_on_the_alarm_and_is_named(tmp_path: Path) -> None:
    """Rank 1 hangs in validation, which is not watched; rank 0's step overruns."""
    (r0, r1), store, _ = ranks(tmp_path, 2, timeout=2)
    for r in (r0, r1):
        r.step(0.5)
    r1.w.on_validation_start(r1.trainer, None)  # type: ignore[arg-type]
    r0.start()
    r0.phase("on_before_backward")
    r0.clock.now += 3
    done: list[HangEvent] = []
    looking = threading.Thread(target=lambda: done.extend(r0.look()))
    looking.start()  # rank 0 raises the alarm, then waits for rank 1's answer
    deadline = time.monotonic() + 10
    while store.data.get("alarms", 0) == 0:
        assert time.monotonic() < deadline, "rank 0 raised no alarm"
        time.sleep(0.01)
    (alarm,) = r1.look()
    looking.join()
    assert (alarm.kind, alarm.rank, alarm.batch, alarm.path) == (
        "alarm", 1, 1, str(tmp_path / "hang-rank1.txt"),
    )  # fmt: skip
    assert [e.kind for e in done] == ["overrun", "report"]
    assert done[1].behind == (RankProgress(1, 1, 0, "validating", 3.0),)


def test_silent_rank_is_named(tmp_path: Path) -> None:
    (r0, _), _, _ = ranks(tmp_path, 2, timeout=2)
    r0.w._answer_wait = 0.2
    r0.start()
    events = r0.look(after=3)
    assert [e.kind for e in events] == ["overrun", "report"]
    assert (events[1].behind, events[1].silent) == ((), (1,))
    assert "rank 1: no answer" in (tmp_path / "hang-report.txt").read_text()


def test_stale_answers_are_not_reused(tmp_path: Path) -> None:
    """A second hang's report waits for fresh answers, not the first hang's."""
    (r0, r1), _, _ = ranks(tmp_path, 2, timeout=2)
    r0.w._answer_wait = 0.2
    for r in (r0, r1):
        r.start()
    r0.phase("on_before_backward")
    r1.look(after=3)
    assert r0.look()[1].behind == (RankProgress(1, 1, 0, "forward", 3.0),)
    for r in (r0, r1):
        r.end()
    r0.start()
    second = r0.look(after=3)  # rank 1 says nothing this time
    assert [e.kind for e in second] == ["recovered", "overrun", "report"]
    assert (second[2].batch, second[2].silent) == (2, (1,))


# --- abort --------------------------------------------------------------------------------------


def test_abort_exits_after_the_dump(tmp_path: Path) -> None:
    (rank,), _, _ = ranks(tmp_path, 1, timeout=2, action="abort")
    on_exit: list[bool] = []

    def exit_(code: int) -> None:
        on_exit.append((tmp_path / "hang-rank0.txt").is_file())
        rank.exits.append(code)

    rank.w._exit = exit_
    rank.start()
    rank.look(after=2.5)
    assert rank.exits == [HANG_EXIT_CODE] == [75]
    assert on_exit == [True]


def test_dump_action_never_exits(tmp_path: Path) -> None:
    (rank,), _, _ = ranks(tmp_path, 1, timeout=2)
    rank.start()
    rank.look(after=100)
    assert rank.exits == []


# --- arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"timeout": 0}, "`timeout` must be a positive number, got 0"),
        ({"timeout": "30"}, "`timeout` must be a positive number, got '30' (a string)"),
        ({"factor": 1}, "`factor` must be a number > 1, got 1"),
        ({"factor": float("nan")}, "`factor`"),
        ({"min_timeout": -5}, "`min_timeout` must be a positive number, got -5"),
        ({"action": "kill"}, "`action` is not one of the choices, got 'kill'"),
        ({"action": "Abort"}, "did you mean `action='abort'`?"),
        ({"dirpath": 3}, "`dirpath` must be a path"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(SpeedkitConfigError, match=re.escape(fragment)):
        HangWatchdog(**kwargs)


@pytest.mark.gpu
def test_step_hooks_never_synchronise_the_device(tmp_path: Path) -> None:
    (rank,), _, _ = ranks(tmp_path, 1)
    loss = torch.ones((), device="cuda") * 2
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            rank.start()
            rank.w.on_before_backward(rank.trainer, None, loss)  # type: ignore[arg-type]
            rank.phase("on_after_backward")
            rank.phase("on_before_optimizer_step")
            rank.clock.now += 0.25
            rank.end()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [seconds for _, seconds in rank.w._steps] == [0.25, 0.25, 0.25]


# --- the thread in a real Trainer -------------------------------------------------------------


def watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "speedkit-hang-watchdog"]


class Probe(L.Callback):
    """Records, at each batch, whether the watchdog thread runs and the limit it holds."""

    def __init__(self, watchdog: HangWatchdog, fail_at: int | None = None) -> None:
        self.watchdog, self.fail_at = watchdog, fail_at
        self.seen: list[tuple[bool, float]] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.seen.append((self.watchdog.running, self.watchdog.threshold()))
        if self.fail_at is not None and len(self.seen) == self.fail_at:
            raise RuntimeError("boom")


def fit(watchdog: HangWatchdog, probe: Probe, tmp_path: Path, steps: int = 7) -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, callbacks=[watchdog, probe],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(MLP(), loader(n=64, batch_size=8))


@pytest.fixture
def no_leftover_threads() -> Iterator[None]:
    yield
    assert watchdog_threads() == []


@pytest.mark.usefixtures("no_leftover_threads")
def test_thread_lives_for_each_fit_and_never_after(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    watchdog = HangWatchdog(min_timeout=30)
    for _ in range(2):
        probe = Probe(watchdog)
        fit(watchdog, probe, tmp_path)
        # running in every step; each fit warms up anew (factor x min_timeout for 5 steps),
        # then holds steps of milliseconds to the 30 s floor
        assert probe.seen == [(True, 300.0)] * 5 + [(True, 30.0)] * 2
        assert not watchdog.running
        assert watchdog_threads() == []
    assert watchdog.events == []
    assert not list(tmp_path.glob("hang-*"))


@pytest.mark.usefixtures("no_leftover_threads")
def test_thread_stops_when_training_fails(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    watchdog = HangWatchdog()
    probe = Probe(watchdog, fail_at=3)
    with pytest.raises(RuntimeError, match="boom"):
        fit(watchdog, probe, tmp_path)
    assert [running for running, _ in probe.seen] == [True, True, True]
    assert not watchdog.running
    probe = Probe(watchdog)
    fit(watchdog, probe, tmp_path, steps=2)  # and the next fit starts it again
    assert [running for running, _ in probe.seen] == [True, True]


def test_dirpath_defaults_to_the_trainers_root(tmp_path: Path) -> None:
    watchdog = HangWatchdog(timeout=5)
    trainer = SimpleNamespace(global_rank=0, world_size=1, default_root_dir=str(tmp_path / "r"))
    watchdog.setup(trainer, None, "fit")  # type: ignore[arg-type]
    try:
        assert watchdog.running
    finally:
        watchdog.teardown(trainer, None, "fit")  # type: ignore[arg-type]
    assert not watchdog.running
    rank = Rank(watchdog, Clock())
    rank.start()
    (event,) = rank.look(after=6)
    assert event.path == str(tmp_path / "r" / "hang-rank0.txt")


# --- two gloo processes -------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_dump_name_the_sleeper_and_train_on(tmp_path: Path) -> None:
    """Both ranks sleep 2.5 s in their first step (a compile: no alarm); rank 1 sleeps 6 s in
    batch 8 while rank 0 waits for it in the all-reduce; the limit is then the 2 s floor."""
    r0, r1 = run_script("hang_ddp.py", tmp_path, "--action", "dump", "--min-timeout", "2",
                        "--first-step", "2.5", "--hang-batch", "8", "--hang-seconds", "6",
                        "--max-steps", "12")  # fmt: skip
    for r in (r0, r1):
        assert r["batches"] == 12  # it trained on
        assert r["running_after_fit"] is False
    # exactly one overrun per rank, in batch 8: none for the slow first step
    assert [(e["kind"], e["batch"]) for e in r0["events"]] == [
        ("overrun", 8), ("report", 8), ("recovered", 8),
    ]  # fmt: skip
    assert [(e["kind"], e["batch"]) for e in r1["events"]] == [("overrun", 8), ("recovered", 8)]
    report = r0["events"][1]
    assert [(p["rank"], p["batch"], p["step"], p["phase"]) for p in report["behind"]] == [
        (1, 8, 7, "forward")
    ]
    assert [p["phase"] for p in report["progress"]] == ["backward", "forward"]
    assert report["silent"] == []
    # The limit and the durations are wall-clock here, judged exactly on the injected clock
    # above; what they must say here: the step that overran is the one that recovered, its
    # duration what it had run at the dump and more, under the limit every look held it to.
    overrun, recovered = r1["events"]
    assert recovered["seconds"] >= overrun["seconds"] > overrun["threshold"]
    assert r0["events"][2]["seconds"] >= r0["events"][0]["seconds"]
    assert report["threshold"] == r0["events"][0]["threshold"]
    # both dumps while rank 1 still slept: its stack is in the sleep, rank 0's in the
    # all-reduce that waits for it
    dumps = tmp_path / "dumps"
    sleeper = (dumps / "hang-rank1.txt").read_text()
    waiter = (dumps / "hang-rank0.txt").read_text()
    assert "in stuck_in_training_step" in sleeper
    assert "stuck_in_training_step" not in waiter
    assert "in backward" in waiter  # waiting in the all-reduce
    assert "Behind: rank 1 (batch 8, forward)." in (dumps / "hang-report.txt").read_text()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_a_rank_stuck_after_its_step_is_caught(tmp_path: Path) -> None:
    """Rank 1 sleeps 6 s in batch 8's end; rank 0 waits for it in the broadcast Lightning
    starts batch 9 with. Neither is in a step: both overrun between steps."""
    r0, r1 = run_script("hang_ddp.py", tmp_path, "--action", "dump", "--min-timeout", "2",
                        "--hang-batch", "8", "--hang-seconds", "6", "--after-step")  # fmt: skip
    for r in (r0, r1):
        assert r["batches"] == 12  # it trained on
        kinds = [(e["kind"], e["batch"], e["between"]) for e in r["events"]]
        assert ("overrun", 8, True) in kinds
        assert ("recovered", 8, True) in kinds
        assert all(e["batch"] == 8 for e in r["events"])
    dumps = tmp_path / "dumps"
    assert "in stuck_after_training_step" in (dumps / "hang-rank1.txt").read_text()
    waiter = (dumps / "hang-rank0.txt").read_text()
    assert "stuck_after_training_step" not in waiter
    assert "_broadcast_sigterm_tensor" in waiter  # where Lightning holds the other ranks
    report = (dumps / "hang-report.txt").read_text()
    assert "all were between steps of one batch" in report


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_abort_ends_the_job_with_the_dumps_on_disk(tmp_path: Path) -> None:
    proc = run_script_failing("hang_ddp.py", tmp_path, "--action", "abort", "--timeout", "2",
                              "--hang-batch", "4", "--hang-seconds", "120")  # fmt: skip
    assert proc.returncode == HANG_EXIT_CODE
    for r in (0, 1):
        assert f"ending rank {r} with exit status 75" in proc.stderr
    dumps = tmp_path / "dumps"
    assert "in stuck_in_training_step" in (dumps / "hang-rank1.txt").read_text()
    assert "why: this rank's step ran" in (dumps / "hang-rank0.txt").read_text()
    report = (dumps / "hang-report.txt").read_text()
    assert "Behind: rank 1 (batch 4, forward)." in report
    assert not list(tmp_path.glob("rank*.json"))  # neither rank finished its fit
