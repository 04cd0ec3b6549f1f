"""The package stays readable: modules, functions and callbacks within their sizes.

STYLE.md asks for modules of at most about 500 lines, functions of at most 80 (their
docstrings left out) and callbacks of at most about 150 (over a Trainer-free core). None
is over today. One that must be for a while is listed in ``OVER`` with the size it has
then: it may only shrink, and when it is split below the limit its entry goes.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_speedkit"
MODULE_LINES, FUNCTION_LINES, CALLBACK_LINES = 500, 80, 150

#: What is still over its limit, at the size it has now ("module.py", "module.py:name").
OVER: dict[str, int] = {}


def _docstring_lines(node: ast.AST) -> int:
    body = getattr(node, "body", [])
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return first.end_lineno - first.lineno + 1  # type: ignore[operator]
    return 0


def _length(node: ast.AST) -> int:
    """Lines of a definition, its docstring (and, for a class, its methods') left out."""
    lines = node.end_lineno - node.lineno + 1 - _docstring_lines(node)  # type: ignore[attr-defined]
    if isinstance(node, ast.ClassDef):
        lines -= sum(_docstring_lines(item) for item in node.body)
    return lines


def _is_callback(node: ast.ClassDef) -> bool:
    return any("Callback" in ast.unparse(base) for base in node.bases)


def sizes() -> Iterator[tuple[str, int, int]]:
    """(name, size, limit) for every module, function and callback class of the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        name = path.relative_to(PACKAGE).as_posix()
        yield name, len(source.splitlines()), MODULE_LINES
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield f"{name}:{node.name}", _length(node), FUNCTION_LINES
            elif isinstance(node, ast.ClassDef) and _is_callback(node):
                yield f"{name}:{node.name}", _length(node), CALLBACK_LINES


def test_nothing_new_is_over_its_limit_and_nothing_listed_grows() -> None:
    over = {name: size for name, size, limit in sizes() if size > limit}
    listed = OVER.get
    grown = {name: (listed(name), size) for name, size in over.items() if size > listed(name, 0)}
    assert not grown, f"over the limit (listed size, size now): {grown}; split it"


def test_each_listed_entry_is_still_over_its_limit() -> None:
    """An entry that was split below its limit leaves the list, so the list stays true."""
    current = {name: (size, limit) for name, size, limit in sizes()}
    stale = [name for name in OVER if name not in current or current[name][0] <= current[name][1]]
    assert not stale, f"no longer over the limit (remove from OVER): {stale}"


def test_the_measure_counts_lines_as_the_limits_mean() -> None:
    source = 'def f():\n    """Doc\n    string."""\n    a = 1\n    return a\n'
    (node,) = ast.parse(source).body
    assert _length(node) == 3  # the def line and two statements, not the docstring
    callback = ast.parse("class C(L.Callback):\n    def f(self):\n        '''d'''\n        pass\n")
    (cls,) = callback.body
    assert _is_callback(cls)
    assert _length(cls) == 3
