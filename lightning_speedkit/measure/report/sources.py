"""Host-device sync call sites: the Python line that made each sync, found from the
trace's Python stacks and the source of the function that made the call.

With ``with_stack=True`` torch records each Python function call as an event named
``file(line): function`` where ``line`` is where the function starts (or, for a frame
already running when the profiler started, where it stood then), never the line that
made a later call. It also records each call into a C function, ``<built-in method item
of Tensor object at 0x...>``, as a child of the frame that made it. A sync's site is
therefore that frame's function and the call's name; the line is read from the
function's source: the one call of that name in its body, or, where the body has several
and runs straight through (no loop or branch around them), the one whose turn it was.
Where neither says, the site names the function and the candidate lines without
claiming one. A sync made inside torch, Lightning or the kit is named but not blamed on
the user's code.
"""

from __future__ import annotations

import ast
import bisect
import io
import re
import sys
import tokenize
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_speedkit.measure.report.kernels import _SYNC_RUNTIME
from lightning_speedkit.measure.report.trace import _Event

_LIBRARY_FRAMES = re.compile(
    r"(^|/)(torch|lightning|pytorch_lightning|lightning_fabric|lightning_utilities|"
    r"lightning_speedkit|torchmetrics|deepspeed|transformers|timm|numpy)/|^<frozen "
)
_FRAME = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<func>.+)$")
_BUILTIN = re.compile(r"^<built-in (?:method|function) (?P<name>[\w.]+)")
# Code that may run a call more than once, or not at all: calls under it have no fixed turn.
_BRANCHES = (
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.If,
    ast.IfExp,
    ast.BoolOp,
    ast.Try,
    ast.Match,
    ast.comprehension,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
)
# Code that runs in a frame of its own (a nested function, a lambda, a class body).
_OWN_FRAMES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_NOT_RECORDED = "(the trace names the function, not the line)"


@dataclass(frozen=True)
class _Call:
    """One call of the wanted name in a function's body: its line, whether its turn is
    fixed (no loop or branch around it), and its place in the source."""

    line: int
    straight: bool
    order: tuple[int, int]


def _python_frames(events: list[_Event]) -> tuple[list[_Event], dict[Any, _Event]]:
    frames = [e for e in events if e.cat == "python_function"]
    by_id = {e.args.get("Python id"): e for e in frames}
    return frames, by_id


class _Sites:
    """Names the site of each sync in one trace: the frames, their calls in order, and
    each source file read once."""

    def __init__(self, events: list[_Event]) -> None:
        self.frames, self.by_id = _python_frames(events)
        self.frames.sort(key=lambda f: f.start)
        self.starts = [f.start for f in self.frames]
        self.children: dict[Any, list[_Event]] = defaultdict(list)
        for f in self.frames:  # in order of start
            self.children[f.args.get("Python parent id")].append(f)
        self.sources: dict[str, tuple[list[str], ast.Module] | None] = {}

    def site(self, op: _Event) -> tuple[str, bool]:
        """Where ``op`` was called, and whether that is the user's code.

        The innermost enclosing frame that is not a built-in decides: a sync made inside
        torch or Lightning is theirs (named, but not blamed on the user's step).
        """
        # Frames are sorted by start: the innermost enclosing one is the latest-starting
        # frame before the op that still runs when the op ends.
        inner = None
        i = bisect.bisect_right(self.starts, op.start) - 1
        while i >= 0:
            f = self.frames[i]
            if f.tid == op.tid and f.end >= op.end:
                inner = f
                break
            i -= 1
        call = None  # the built-in called directly by the frame above it
        seen = 0
        while inner is not None and seen < 64:
            match = _FRAME.match(inner.name)
            if match:
                user = not _LIBRARY_FRAMES.search(match["file"])
                return self._line(
                    inner, match["file"], int(match["line"]), match["func"], call
                ), user
            call = inner if _called(inner) else None
            inner = self.by_id.get(inner.args.get("Python parent id"))
            seen += 1
        return "unknown (profile with with_stack=True to name it)", False

    def _line(self, frame: _Event, file: str, first: int, func: str, call: _Event | None) -> str:
        name = _called(call) if call else None
        parsed = self._source(file)
        scope = _scope(parsed[1], first, func) if parsed else None
        if parsed is None or scope is None or name is None:
            said = f", its {name}() call" if name else ""
            return f"{file} in {func}{said} {_NOT_RECORDED}"
        lines = parsed[0]
        calls = sorted(_calls(scope, name), key=lambda c: c.order)
        line = None
        if len(calls) == 1:
            line = calls[0].line
        elif calls and all(c.straight for c in calls) and first == _first_line(scope):
            # entered while profiling, so every call it made is in the trace: the k-th
            # call of this name is the k-th in the source when each runs exactly once
            made = [c for c in self.children[frame.args.get("Python id")] if _called(c) == name]
            if len(made) == len(calls) and call in made:
                line = calls[made.index(call)].line
        if line is not None:
            return f"{file}:{line} in {func}: {_code(lines[line - 1])}"
        if not calls:
            return f"{file} in {func}, its {name}() call {_NOT_RECORDED}"
        where = sorted({c.line for c in calls})
        listed = ", ".join(map(str, where[:-1])) + f" or {where[-1]}"
        return f"{file} in {func}, its {name}() on line {listed} {_NOT_RECORDED}"

    def _source(self, file: str) -> tuple[list[str], ast.Module] | None:
        if file not in self.sources:
            self.sources[file] = _read_source(file)
        return self.sources[file]


def _called(event: _Event) -> str | None:
    """The name of the built-in ``event`` records a call of (``item``), else None."""
    match = _BUILTIN.match(event.name)
    return match["name"].rsplit(".", 1)[-1] if match else None


def _code(line: str) -> str:
    """A source line's code, without its trailing comment."""
    try:
        for token in tokenize.generate_tokens(io.StringIO(line).readline):
            if token.type == tokenize.COMMENT:
                return line[: token.start[1]].strip()
    except (tokenize.TokenError, SyntaxError):  # a line inside a longer statement or string
        pass
    return line.strip()


def _read_source(file: str) -> tuple[list[str], ast.Module] | None:
    """A file's lines and syntax tree, looked up as the trace wrote its name (absolute,
    or relative to an entry of ``sys.path``); None where it cannot be read."""
    for path in [Path(file), *(Path(p) / file for p in sys.path if p)]:
        try:
            with tokenize.open(path) as handle:  # the source's own encoding, not the locale's
                source = handle.read()
        except (OSError, SyntaxError, UnicodeDecodeError):  # SyntaxError: a bad coding line
            continue
        try:
            return source.splitlines(), ast.parse(source)
        except SyntaxError:
            return None
    return None


def _first_line(node: ast.AST) -> int:
    """The line a function's frame starts on: its first decorator's, else its ``def``."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return 1  # a module's


def _scope(tree: ast.Module, line: int, func: str) -> ast.AST | None:
    """The code the frame ``func`` at ``line`` runs: the innermost function of that name
    around the line, or the module's own statements for ``<module>``."""
    if func == "<module>":
        return tree
    short = func.rsplit(".", 1)[-1]  # a qualified name, where a tracer writes one
    found: ast.AST | None = None
    for node in ast.walk(tree):
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name == short
            and _first_line(node) <= line <= (node.end_lineno or node.lineno)
            and (found is None or _first_line(node) > _first_line(found))
        ):
            found = node
    return found


def _calls(scope: ast.AST, name: str) -> Iterator[_Call]:
    """The calls of ``name`` (``x.name(...)`` or ``name(...)``) the frame of ``scope``
    makes itself, not those of functions or classes defined inside it."""

    def walk(node: ast.AST, straight: bool) -> Iterator[_Call]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _OWN_FRAMES):
                continue
            if isinstance(child, ast.Call):
                f = child.func
                if isinstance(f, ast.Attribute) and f.attr == name:
                    # the line the name is on, for a call chained over several lines
                    line = f.end_lineno or child.lineno
                    yield _Call(line, straight, (child.lineno, child.col_offset))
                elif isinstance(f, ast.Name) and f.id == name:
                    yield _Call(child.lineno, straight, (child.lineno, child.col_offset))
            yield from walk(child, straight and not isinstance(child, _BRANCHES))

    for statement in scope.body:  # type: ignore[attr-defined]
        if not isinstance(statement, _OWN_FRAMES):
            yield from walk(ast.Module(body=[statement], type_ignores=[]), True)


def _sync_sites(
    events: list[_Event], host: list[_Event], steps: int, step_time: float, on_device: bool
) -> list[dict[str, Any]]:
    runtime = [e for e in host if e.name in _SYNC_RUNTIME]
    # An item() shows as _local_scalar_dense, with the runtime sync inside it on CUDA. On a
    # device trace one without a sync inside read a CPU tensor (an optimizer's step count):
    # that waits for nothing.
    scalars = [e for e in host if e.name == "aten::_local_scalar_dense"]
    if on_device:
        scalars = [o for o in scalars if any(o.start <= e.start <= o.end for e in runtime)]
    rest = [e for e in runtime if not any(o.start <= e.start <= o.end for o in scalars)]
    if not scalars and not rest:
        return []
    named = _Sites(events)
    sites: dict[tuple[str, bool], list[float]] = defaultdict(list)
    for e in scalars + rest:
        sites[named.site(e)].append(e.dur)
    rows = [
        {
            "site": site,
            "user_code": user,
            "per_step": len(d) / steps,
            "ms_per_step": sum(d) / steps / 1e3,
            "share": sum(d) / step_time,
        }
        for (site, user), d in sites.items()
    ]
    return sorted(rows, key=lambda r: -r["per_step"])
