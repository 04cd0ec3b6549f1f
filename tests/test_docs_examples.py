"""Every ```python block in the docs and the README runs, as a reader would run it.

Each block is written to ``example.py`` in an empty directory of its own and run there
as ``python example.py`` would run it: its own process, working directory, ``argv``,
``__main__`` namespace (so ``if __name__ == "__main__":`` and Lightning's launcher,
which starts rank 1 as ``python example.py`` again, behave as for a reader), stdout,
stderr and exit status. It passes when it exits 0 within ``TIMEOUT``. The examples
assert what the page promises (``assert ramp.accumulation(...) == ...``), so a wrong
figure fails here too, not only a wrong name.

A block that cannot run as written (it needs the reader's own model or dataset, a GPU,
several machines) carries a mark on the line right before its fence, with the reason::

    <!-- fragment: needs your own LightningModule and datamodule -->

mkdocs renders nothing of the comment. A block without the mark must run, and name
nothing it does not define (ruff's F821, which also looks inside functions the example
never calls); a mark without a reason, or one not followed by a ```python fence, fails.

Why the examples are forked from one interpreter rather than each started anew: they
nearly all begin with ``import lightning``, about 6 s of CPU on a busy 2-core machine,
and forty of them spent four minutes importing. One interpreter imports torch and
Lightning, and each example runs in a process forked from it (two at a time). Nothing
of lightning_speedkit or speedkit_examples is imported before the fork, and imports
bind names only in the example's own namespace: an example that forgets an import, or
forgets ``import lightning_speedkit`` before naming one of its strategies, still fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
#: Seconds one example may take. The slowest (two training processes) take about 10.
TIMEOUT = 120
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*fragment\b:?\s*(?P<reason>.*?)\s*-->$")
#: Launcher and distributed variables of this process, which a reader's shell does not have.
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its code and its fragment mark."""

    page: str  # relative to the repository: docs/compute.md, README.md
    line: int  # the block's first line of code, 1-based, as an editor shows it
    language: str
    code: str
    fragment: str | None  # the mark's reason ("" when it gives none); None: no mark

    @property
    def id(self) -> str:
        return f"{Path(self.page).name}:L{self.line}"


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    start, language, mark = 0, "", None
    for number, line in enumerate(lines, start=1):
        fence = _FENCE.match(line.strip())
        if not start and fence:
            found = _MARK.match(lines[number - 2].strip()) if number > 1 else None
            start, language, mark = number + 1, fence.group(1), found and found["reason"]
        elif start and line.strip() == "```":
            code = "\n".join(lines[start - 1 : number - 1]) + "\n"
            blocks.append(Block(path.relative_to(REPO).as_posix(), start, language, code, mark))
            start = 0
    return blocks


ALL_BLOCKS = [block for page in PAGES if page.exists() for block in _blocks(page)]
PYTHON = [block for block in ALL_BLOCKS if block.language == "python"]
RUNNABLE = [block for block in PYTHON if block.fragment is None]


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _DIST_VARS and not k.startswith(("PL_", "TORCHELASTIC_", "PYTEST_"))
    }
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = ""  # the installed packages, not the checkout's tests/
    return env


# Reads one directory per line from stdin, forks, answers the child's pid. The child
# becomes `python example.py` in that directory and writes its exit status to the file
# `returncode` as it ends. SIGCHLD is ignored in the server, so the kernel reaps the
# children; each child puts the default back before it runs the example.
_SERVER = r"""
import atexit, os, runpy, signal, sys, traceback
import torch, lightning  # what nearly every example imports first: paid once, here

signal.signal(signal.SIGCHLD, signal.SIG_IGN)
for line in sys.stdin:
    directory = line.strip()
    pid = os.fork()
    if pid:
        print(pid, flush=True)
        continue
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()  # a group of its own: a timeout kills the example and all it started
    os.chdir(directory)
    for fd, name in ((0, os.devnull), (1, "stdout"), (2, "stderr")):
        flags = os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        os.dup2(os.open(name, flags), fd)
    sys.stdin = open(0)
    sys.stdout.reconfigure(line_buffering=True)  # what was printed survives a timeout
    sys.argv = [os.path.join(directory, "example.py")]
    sys.path[0] = directory
    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    except BaseException as error:
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != sys.argv[0]:
            tb = tb.tb_next  # from the example's own frame on, as `python example.py` shows
        traceback.print_exception(type(error), error, tb)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    with open("returncode.tmp", "w") as f:
        f.write(str(code))
    os.rename("returncode.tmp", "returncode")
    os._exit(code)
"""


@dataclass(frozen=True)
class _Run:
    status: str  # "exited 0", "exited 1", "timed out", "died without status"
    stdout: str
    stderr: str
    seconds: float


class _Server:
    """The interpreter with torch and Lightning imported; `start` forks an example off it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            env=_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lock = threading.Lock()

    def start(self, directory: Path) -> int:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        if stdin is None or stdout is None:
            raise RuntimeError("the example server has no pipes")
        with self.lock:
            stdin.write(f"{directory}\n")
            stdin.flush()
            answer = stdout.readline()
        if not answer:
            raise RuntimeError(f"the example server exited ({self.proc.poll()}): see stderr")
        return int(answer)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _run(server: _Server, block: Block, directory: Path) -> _Run:
    directory.mkdir(parents=True)
    (directory / "example.py").write_text(block.code, encoding="utf-8")
    done = directory / "returncode"
    pid = server.start(directory)
    begin = time.perf_counter()
    status = "timed out"
    while time.perf_counter() - begin < TIMEOUT:
        if done.exists():
            status = f"exited {done.read_text()}"
            break
        try:
            os.kill(pid, 0)
        except ProcessLookupError:  # gone (a signal, os._exit) without writing its status
            status = f"exited {done.read_text()}" if done.exists() else "died without status"
            break
        time.sleep(0.05)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    seconds = time.perf_counter() - begin
    return _Run(status, _read(directory / "stdout"), _read(directory / "stderr"), seconds)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""  # none: killed early


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[_Run]]]:
    """Start every selected example, two at a time, each in an empty directory of its own."""
    selected = {
        item.callspec.params["block"].id
        for item in request.session.items
        if getattr(item, "module", None) is sys.modules[__name__] and hasattr(item, "callspec")
    }
    root = tmp_path_factory.mktemp("docs-examples")
    server = _Server()
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {
        block.id: pool.submit(_run, server, block, root / block.id.replace(":", "-"))
        for block in RUNNABLE
        if block.id in selected
    }
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)
    server.close()


def test_the_pages_have_examples_and_each_is_found() -> None:
    """The parser found the blocks (an empty list would pass every check below)."""
    assert len(PYTHON) >= 40, [block.id for block in PYTHON]
    assert len(RUNNABLE) >= 0.75 * len(PYTHON), "a fragment is the exception"
    # A python block under another name would be skipped without a word.
    other = [b.id for b in ALL_BLOCKS if b.language.startswith("py") and b.language != "python"]
    assert not other, f"fence these as ```python: {other}"


def test_fragment_marks_give_a_reason_and_sit_on_a_python_block() -> None:
    for page in PAGES:
        if not page.exists():
            continue
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, start=1):
            if not re.match(r"<!--\s*fragment", line.strip()):
                continue
            where = f"{page.relative_to(REPO)}:L{number}"
            found = _MARK.match(line.strip())
            assert found, f"{where}: write the mark as `<!-- fragment: why -->`"
            assert found["reason"], f"{where}: say why the block cannot run"
            following = lines[number].strip() if number < len(lines) else ""
            assert following == "```python", f"{where}: no ```python fence on the next line"


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="needs ruff (the test extra)")
def test_examples_name_nothing_undefined(tmp_path: Path) -> None:
    """A name used only in a function the example never calls would pass the run below."""
    files = {f"{block.id.replace('.md:', '_')}.py": block for block in RUNNABLE}
    for name, block in files.items():
        (tmp_path / name).write_text(block.code, encoding="utf-8")
    check = [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F821"]
    proc = subprocess.run(
        [*check, "--output-format", "concise", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.findall(r"^(\S+?\.py):(\d+):\d+: F821 (.*)$", proc.stdout, flags=re.MULTILINE)
    assert proc.returncode == 0 or found, proc.stdout + proc.stderr
    where = [
        f"{files[name].page} line {files[name].line + int(n) - 1}: {msg}" for name, n, msg in found
    ]
    assert not where, "define these, or mark the block a fragment:\n" + "\n".join(where)


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.id for block in RUNNABLE])
def test_example_runs(block: Block, runs: dict[str, Future[_Run]]) -> None:
    result = runs[block.id].result()
    if result.status == "exited 0":
        return
    pytest.fail(
        f"{block.page} line {block.line}: the example {result.status} after"
        f" {result.seconds:.0f} s. Fix it, or mark it `<!-- fragment: why -->` if it cannot"
        f" run as written. Line N of example.py is line {block.line} + N - 1 of the page."
        f"\n--- stdout (tail) ---\n{result.stdout[-2000:]}"
        f"\n--- stderr (tail) ---\n{result.stderr[-4000:]}",
        pytrace=False,
    )
