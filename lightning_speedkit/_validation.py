"""Checks of user arguments: one function per kind of value, one line per error.

Every public constructor and function of the kit checks its arguments here, so every
bad input is refused the same way, as early as it can be: a
:class:`~lightning_speedkit.errors.SpeedkitConfigError` whose one-line message names
the argument in backticks, shows the value received, says why it is wrong and gives
the fix::

    `timeout` must be a positive number, got '30' (a string); pass a number, e.g. 30,
    not the string '30'.

(one line in the real message). What the checks hold to:

- A number is an ``int``, a ``float`` or a numpy scalar, never a ``bool`` (Python counts
  ``True`` as 1), never a string (``"1e-3"`` from a config file is refused with the
  number it spells), and never NaN or infinity.
- An integer is integral: ``2.0`` is refused with ``2`` as the fix.
- A flag is ``True`` or ``False``: ``"false"`` (truthy) and ``0``/``1`` are refused.
- A choice is one of its values; a near miss is named (``"adamw"`` for ``"adam_w"``).
- Keyword arguments a class passes on (``**kwargs`` to Lightning's strategies) are
  checked against the signatures they flow into, at construction.

Each check returns the value as it will be used (a Python ``int`` or ``float``).
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from lightning_speedkit.errors import SpeedkitConfigError

__all__ = [
    "accepted_keywords",
    "boolean",
    "check_keywords",
    "choice",
    "fail",
    "function",
    "instance",
    "integer",
    "non_negative_int",
    "non_negative_number",
    "number",
    "optional",
    "parse_number",
    "path",
    "positive_int",
    "positive_number",
    "probability",
    "show",
    "text",
]

T = TypeVar("T")

_MAX_SHOWN = 80


def show(value: Any) -> str:
    """``repr(value)`` on one short line, with a note where the repr misleads."""
    shown = repr(value)
    if "\n" in shown:
        shown = f"a {type(value).__name__} object"
    elif len(shown) > _MAX_SHOWN:
        shown = f"{shown[: _MAX_SHOWN - 20]}... (a {type(value).__name__})"
    elif isinstance(value, str):
        shown += " (a string)"
    elif _is_bool(value):
        shown += " (a bool)"
    return shown


def fail(name: str, value: Any, why: str, fix: str) -> NoReturn:
    """Raise the one-line error: ```name` why, got value; fix.``"""
    message = f"`{name}` {why}, got {show(value)}; {fix.rstrip('.')}."
    raise SpeedkitConfigError(" ".join(message.splitlines()))  # one line, whatever went in


def _is_bool(value: Any) -> bool:
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy" and "bool" in kind.__name__)


def _fmt(x: float) -> str:
    if isinstance(x, int):
        return str(x)
    return str(int(x)) if x.is_integer() and abs(x) < 1e7 else f"{x:g}"


def parse_number(text: str) -> float | None:
    """The finite number a string spells (``"1e-3"``, ``"10_000"``), or None."""
    try:
        parsed = float(text.strip().replace("_", ""))
    except ValueError:
        return None
    return parsed if math.isfinite(parsed) else None


def _with_hint(fix: str, hint: str) -> str:
    return f"{fix} ({hint})" if hint else fix


# --- numbers ---------------------------------------------------------------------------------


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{_fmt(low)}, {_fmt(high)}{')' if high_open else ']'}"
    if low is not None:
        return f"> {_fmt(low)}" if low_open else f">= {_fmt(low)}"
    if high is not None:
        return f"< {_fmt(high)}" if high_open else f"<= {_fmt(high)}"
    return ""


def _inside(x: float, low: float | None, high: float | None, lo_open: bool, hi_open: bool) -> bool:
    if low is not None and (x <= low if lo_open else x < low):
        return False
    return high is None or (x < high if hi_open else x <= high)


def _example(low: float | None, high: float | None, low_open: bool, integral: bool) -> float:
    if low is not None and high is not None:
        return low if not low_open else (high if integral else (low + high) / 2)
    if low is not None:
        return low + 1 if low_open else low
    return high if high is not None else 1


def number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    example: float | None = None,
    hint: str = "",
) -> float:
    """A finite real number within the bounds, as a ``float``.

    Example::

        >>> number("tolerance", 1e-3, low=0, low_open=True)
        0.001
        >>> number("timeout", "30", low=0, low_open=True)
        Traceback (most recent call last):
        ...
        lightning_speedkit.errors.SpeedkitConfigError: `timeout` must be a positive number, got '30' (a string); pass a number, e.g. 30, not the string '30'.
    """  # noqa: E501
    what = "a positive number" if low == 0 and low_open and high is None else None
    if what is None:
        bounds = _bounds(low, high, low_open, high_open)
        what = f"a number {bounds}" if bounds else "a finite number"
    good = example if example is not None else _example(low, high, low_open, integral=False)
    if isinstance(value, str):
        parsed = parse_number(value)
        if parsed is not None and _inside(parsed, low, high, low_open, high_open):
            fail(name, value, f"must be {what}",
                 f"pass a number, e.g. {_fmt(parsed)}, not the string {value!r}")  # fmt: skip
        fail(name, value, f"must be {what}", f"pass a number, e.g. `{name}={_fmt(good)}`")
    if _is_bool(value) or not isinstance(value, numbers.Real):
        fail(name, value, f"must be {what}",
             _with_hint(f"pass a number, e.g. `{name}={_fmt(good)}`", hint))  # fmt: skip
    x = float(value)
    if not math.isfinite(x):
        fail(name, value, f"must be a finite {what.removeprefix('a ')}",
             _with_hint(f"pass e.g. `{name}={_fmt(good)}`", hint))  # fmt: skip
    if not _inside(x, low, high, low_open, high_open):
        fail(name, value, f"must be {what}",
             _with_hint(f"pass e.g. `{name}={_fmt(good)}`", hint))  # fmt: skip
    return x


def positive_number(
    name: str, value: Any, *, example: float | None = None, hint: str = ""
) -> float:
    """A finite number > 0 (seconds, megabytes, tolerances, rates)."""
    return number(name, value, low=0, low_open=True, example=example, hint=hint)


def non_negative_number(
    name: str, value: Any, *, example: float | None = None, hint: str = ""
) -> float:
    """A finite number >= 0."""
    return number(name, value, low=0, example=example, hint=hint)


def probability(
    name: str,
    value: Any,
    *,
    low_open: bool = False,
    high_open: bool = False,
    example: float | None = None,
    hint: str = "",
) -> float:
    """A share in [0, 1] (either end may be excluded)."""
    return number(name, value, low=0, high=1, low_open=low_open, high_open=high_open,
                  example=example, hint=hint)  # fmt: skip


def integer(
    name: str,
    value: Any,
    *,
    at_least: int | None = None,
    at_most: int | None = None,
    example: int | None = None,
    hint: str = "",
) -> int:
    """An integer (numpy's too; never a bool or a float) within the bounds, as an ``int``.

    Example::

        >>> integer("rank", 2, at_least=1)
        2
        >>> integer("wait", 2.0, at_least=0)
        Traceback (most recent call last):
        ...
        lightning_speedkit.errors.SpeedkitConfigError: `wait` must be an integer >= 0, got 2.0; pass `wait=2`.
    """  # noqa: E501
    bounds = _bounds(at_least, at_most, False, False)
    what = f"an integer {bounds}" if bounds else "an integer"
    good = example if example is not None else int(_example(at_least, at_most, False, True))
    if isinstance(value, str):
        parsed = parse_number(value)
        if parsed is not None and parsed.is_integer() and _inside(parsed, at_least, at_most,
                                                                  False, False):  # fmt: skip
            fail(name, value, f"must be {what}",
                 f"pass a number, e.g. {int(parsed)}, not the string {value!r}")  # fmt: skip
        fail(name, value, f"must be {what}", f"pass a number, e.g. `{name}={good}`")
    if (
        isinstance(value, numbers.Real)
        and not _is_bool(value)
        and not isinstance(value, numbers.Integral)
    ):
        x = float(value)
        if math.isfinite(x) and _inside(round(x), at_least, at_most, False, False):
            fix = (
                f"pass `{name}={round(x)}`" if x.is_integer() else f"pass e.g. `{name}={round(x)}`"
            )
            fail(name, value, f"must be {what}", _with_hint(fix, hint))
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        fail(name, value, f"must be {what}", _with_hint(f"pass e.g. `{name}={good}`", hint))
    n = int(value)
    if not _inside(n, at_least, at_most, False, False):
        fail(name, value, f"must be {what}", _with_hint(f"pass e.g. `{name}={good}`", hint))
    return n


def positive_int(name: str, value: Any, *, example: int | None = None, hint: str = "") -> int:
    """An integer >= 1 (counts, sizes, steps between logs)."""
    return integer(name, value, at_least=1, example=example, hint=hint)


def non_negative_int(name: str, value: Any, *, example: int | None = None, hint: str = "") -> int:
    """An integer >= 0."""
    return integer(name, value, at_least=0, example=example, hint=hint)


# --- other kinds -----------------------------------------------------------------------------


def boolean(name: str, value: Any) -> bool:
    """``True`` or ``False`` (numpy's too); ``"false"``, ``0`` and ``None`` are refused."""
    if _is_bool(value):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        meant = value.strip().lower() == "true"
        fix = f"pass `{name}={meant}`, not the string {value!r} (any non-empty string is true)"
        fail(name, value, "must be True or False", fix)
    fail(name, value, "must be True or False", f"pass `{name}=True` or `{name}=False`")


def choice(
    name: str,
    value: Any,
    choices: Collection[Any],
    *,
    why: str = "is not one of the choices",
    hint: str = "",
) -> Any:
    """One of ``choices`` (compared with ``==``); a near miss is suggested."""
    options = list(choices)
    for option in options:
        try:
            if value == option and _is_bool(value) == _is_bool(option):  # True is not 1
                return value
        except Exception:  # a value whose == raises or is ambiguous (an array): no choice
            continue
    listed = ", ".join(repr(option) for option in options)
    fix = f"pass one of {listed}"
    if isinstance(value, str):
        by_lower = {option.lower(): option for option in options if isinstance(option, str)}
        close = difflib.get_close_matches(value.lower(), list(by_lower), n=1, cutoff=0.75)
        if close:
            fix = f"did you mean `{name}={by_lower[close[0]]!r}`? The choices are {listed}"
    fail(name, value, why, _with_hint(fix, hint))


def function(name: str, value: Any, *, fix: str) -> Callable[..., Any]:
    """A callable; ``fix`` says what to pass (e.g. ``pass `lambda batch: ...```)."""
    if not callable(value):
        fail(name, value, "must be a function", fix)
    return value


def text(name: str, value: Any, *, example: str, empty: bool = False) -> str:
    """A string, non-empty unless ``empty``."""
    if not isinstance(value, str) or (not empty and not value.strip()):
        fail(name, value, "must be a non-empty string" if not empty else "must be a string",
             f"pass e.g. `{name}={example!r}`")  # fmt: skip
    return value


def path(name: str, value: Any) -> str | os.PathLike[str]:
    """A filesystem path (a string or ``os.PathLike``)."""
    if not isinstance(value, (str, os.PathLike)) or (isinstance(value, str) and not value):
        fail(name, value, "must be a path (a string or pathlib.Path)",
             f"pass e.g. `{name}='runs/speedkit'`")  # fmt: skip
    return value


def instance(name: str, value: Any, kinds: type | tuple[type, ...], *, what: str, fix: str) -> Any:
    """``value`` if it is an instance of ``kinds`` (``what`` says what that is, in words)."""
    if not isinstance(value, kinds):
        fail(name, value, f"must be {what}", fix)
    return value


def optional(check: Callable[..., T], name: str, value: Any, **options: Any) -> T | None:
    """``None``, or whatever ``check(name, value, **options)`` accepts.

    Example::

        >>> optional(positive_int, "max_workers", None), optional(positive_int, "max_workers", 4)
        (None, 4)
    """
    return None if value is None else check(name, value, **options)


# --- keyword arguments passed on -------------------------------------------------------------


def accepted_keywords(*targets: Callable[..., Any], exclude: Iterable[str] = ()) -> set[str]:
    """Names of the keyword arguments ``targets`` take (``self``, ``*args``, ``**kwargs`` left out).

    Used for the ``**kwargs`` a class passes on: to Lightning's strategy, and from there
    to torch's wrapper (``DistributedDataParallel``, ``FullyShardedDataParallel``).
    """
    names: set[str] = set()
    for target in targets:
        for parameter in inspect.signature(target).parameters.values():
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
                names.add(parameter.name)
    return names - {"self", *exclude}


def check_keywords(owner: str, given: Mapping[str, Any], accepted: Collection[str]) -> None:
    """Refuse a keyword argument ``owner`` would pass on to something that does not take it."""
    for key in given:
        if key in accepted:
            continue
        close = difflib.get_close_matches(key, list(accepted), n=1, cutoff=0.75)
        guess = f"did you mean `{close[0]}`? " if close else ""
        fail(key, given[key], f"is not an argument of {owner}",
             f"{guess}{owner} accepts {', '.join(sorted(accepted))}")  # fmt: skip


def directory(name: str, value: Any, *, fix: str) -> Path:
    """A folder path that can be created or written: refused when it is not a path, is a
    file or under one, or its nearest existing folder is not writable. Creates nothing
    (:func:`write_error` writes to find out).

    Example::

        >>> directory("dirpath", __file__, fix="pass a folder")
        Traceback (most recent call last):
        ...
        lightning_speedkit.errors.SpeedkitConfigError: `dirpath` is a file, got '...' (a string); pass a folder.
    """  # noqa: E501
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        fail(name, value, "must be a path or None", fix)
    path = Path(os.fspath(value)).expanduser()
    existing = path
    while not _exists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():  # the nearest that exists (or the root)
        fail(name, str(path), "is a file" if existing == path else f"is under a file ({existing})",
             fix)  # fmt: skip
    if not os.access(existing, os.W_OK | os.X_OK):
        fail(name, str(path), f"cannot be written to ({existing})", fix)
    return path


def _exists(path: Path) -> bool:
    """Whether ``path`` exists; False where asking is refused (under a folder this user
    cannot search, where ``Path.exists`` raises on Python 3.11)."""
    try:
        return path.exists()
    except OSError:
        return False


def write_error(directory: str | os.PathLike[str], probe: str) -> OSError | None:
    """Why ``directory`` cannot take files: it is created if missing, and a file named
    ``probe`` is written in it and removed again; None when that worked."""
    try:
        os.makedirs(directory, exist_ok=True)
        target = os.path.join(directory, probe)
        with open(target, "wb"):
            pass
        os.unlink(target)
    except OSError as error:
        return error
    return None
