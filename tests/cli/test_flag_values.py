"""Flag values: the kit's range checks, refused in the flag's words (argparse's style)."""

from __future__ import annotations

import argparse

import pytest

from lightning_speedkit.cli._flag_values import (
    integer,
    non_negative_int,
    positive_float,
    positive_int,
    real,
)


@pytest.mark.parametrize(
    ("text", "expected"), [("1", 1), ("7", 7), ("10_000", 10_000), (" 3 ", 3), ("007", 7)]
)
def test_a_positive_integer_as_python_reads_it(text: str, expected: int) -> None:
    assert positive_int(text) == expected


@pytest.mark.parametrize(
    ("check", "text", "message"),
    [
        (positive_int, "0", "must be a positive integer, got 0"),
        (positive_int, "-00", "must be a positive integer, got 0"),  # the number, as read
        (positive_int, "1.5", "must be a positive integer, got '1.5'"),  # not read: quoted
        (positive_int, "inf", "must be a positive integer, got 'inf'"),
        (non_negative_int, "-1", "must be 0 or more, got -1"),
        (positive_float, "0", "must be a positive finite number, got 0"),  # the text
        (positive_float, "-0.0", "must be a positive finite number, got -0.0"),
        (positive_float, "inf", "must be a positive finite number, got inf"),
        (positive_float, "nan", "must be a positive finite number, got nan"),
        (positive_float, "8GiB", "must be a positive finite number, got '8GiB'"),
    ],
)
def test_a_refusal_says_what_the_flag_takes_and_what_it_got(
    check: object, text: str, message: str
) -> None:
    assert _refused(check, text) == message


def _refused(check: object, *args: object, **kwargs: object) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as info:
        check(*args, **kwargs)  # type: ignore[operator]
    return str(info.value)


def test_bounds_are_inclusive_unless_the_low_end_is_open() -> None:
    seed = "a seed"
    assert integer("0", seed, 0, 2**32 - 1) == 0
    assert integer("4294967295", seed, 0, 2**32 - 1) == 2**32 - 1
    assert _refused(integer, "4294967296", seed, 0, 2**32 - 1) == "must be a seed, got 4294967296"
    share = "a share"
    assert real("1", share, 0.0, high=1.0) == 1.0
    assert real("1e-9", share, 0.0, high=1.0) == 1e-9
    for text in ("0", "1.0000001"):
        assert _refused(real, text, share, 0.0, high=1.0) == f"must be a share, got {text}"
    assert real("1", "a count", 1.0, open_low=False) == 1.0  # closed: 1 is in
    assert _refused(real, "0.999", "a count", 1.0, open_low=False) == "must be a count, got 0.999"
