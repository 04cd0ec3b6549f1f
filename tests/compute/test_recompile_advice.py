"""The recompile warning's text, a pure function: each cause gets its own fix."""

from __future__ import annotations

import pytest

from lightning_speedkit.compute._recompile_advice import (
    _is_shape_guard,
    _one_line,
    recompile_advice,
)

SAID = (
    "RegionalCompile: a compiled block recompiled 5 times (6 recompilations, 12.3 s "
    "compiling so far)"
)
SHAPE = "tensor 'L['x']' size mismatch at index 1. expected 8, actual 9"


def test_a_kv_cache_is_named_first_whatever_else_is_known() -> None:
    advice = recompile_advice(5, 6, 12.34, SHAPE, cache_called=True, dynamic=True)
    assert advice == (
        f"{SAID}: its calls carry a KV cache (`past_key_values`), and each layer reads its own "
        f"slot of it, so each layer compiles a graph of its own; past dynamo's limit (8) it "
        f"runs uncompiled. Training needs no cache: pass `use_cache=False` to the model, or set "
        f"`model.config.use_cache = False` (changing shapes are not the cause, and "
        f"`dynamic=True` would not help)."
    )


def test_changing_shapes_suggest_dynamic_shapes_or_fewer_shapes() -> None:
    advice = recompile_advice(5, 6, 12.34, SHAPE, cache_called=False, dynamic=None)
    assert advice == (
        f"{SAID} (dynamo's last reason: `{SHAPE}`): batch shapes keep changing; past dynamo's "
        f"limit (8) it runs uncompiled. Compile for symbolic shapes with "
        f"`RegionalCompile(dynamic=True)`, or give batches fewer distinct shapes: length "
        f"bucketing or sequence packing (SpeedDataModuleMixin's `lengths=` or PackingCollate). "
        f"`TORCH_LOGS=recompiles` shows the guard that fails."
    )


def test_with_dynamic_already_on_the_length_is_not_blamed() -> None:
    advice = recompile_advice(5, 6, 12.34, SHAPE, cache_called=False, dynamic=True)
    assert advice.startswith(f"{SAID} (dynamo's last reason: `{SHAPE}`), with `dynamic=True` "
                             "already set, so not because a length changes;")  # fmt: skip
    assert "RegionalCompile(dynamic=True)" not in advice


def test_a_guard_on_another_value_says_to_keep_it_fixed() -> None:
    reason = "L['self'].scale == 2.0"
    advice = recompile_advice(5, 6, 12.34, reason, cache_called=False, dynamic=False)
    assert advice.startswith(
        f"{SAID}, not because a shape changes: dynamo's last reason is `{reason}`; "
    )
    assert "keep it fixed during training, or pass it as a tensor" in advice
    assert "RegionalCompile(dynamic=True)" not in advice


def test_without_a_reason_both_fixes_are_given() -> None:
    advice = recompile_advice(5, 6, 12.34, None, cache_called=False, dynamic=None)
    assert advice.startswith(f"{SAID}; past dynamo's limit (8) it runs uncompiled. dynamo's "
                             "reason could not be read")  # fmt: skip
    assert "`RegionalCompile(dynamic=True)`" in advice
    assert "keep it fixed during training" in advice


@pytest.mark.parametrize(
    ("reason", "shape"),
    [
        (SHAPE, True),
        ("tensor 'x' stride mismatch at index 0", True),
        ("tensor 'x' rank mismatch. expected 2, actual 3", True),
        ("L['x'].size()[1] <= 8", True),
        ("___check_obj_id(L['self'].training, 1)", False),
        ("L['n'] == 3", False),
    ],
)
def test_shape_guards_are_told_from_other_guards(reason: str, shape: bool) -> None:
    assert _is_shape_guard(reason) is shape


def test_a_long_reason_is_one_line_of_at_most_200_characters() -> None:
    assert _one_line("a\n  b\tc") == "a b c"
    long = "x" * 250
    assert _one_line(long) == "x" * 197 + "..."
    assert len(_one_line(long)) == 200
