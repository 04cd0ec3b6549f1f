"""The recompile warning's text, a pure function: each cause gets its own fix."""

from __future__ import annotations

import pytest
from torch import Tensor, nn

from lightning_speedkit.compute._recompile_advice import (
    Recompiling,
    _is_shape_guard,
    _one_line,
    recompile_advice,
    recompiling_block,
    warn_at,
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


# --- the threshold, capped at dynamo's limit ------------------------------------------------


@pytest.mark.parametrize(
    ("recompile_warning", "classes", "limit", "at"),
    [
        (4, 1, 8, 4),  # the default: well before the limit
        (4, 4, 8, 7),  # 4 + 4 - 1 = 7: the last recompilation dynamo makes
        (4, 5, 8, 7),  # 4 + 5 - 1 = 8 was never reached: a function stops at 7
        (4, 9, 8, 7),
        (4, 1, 4, 3),  # a lower limit set in torch: 4 graphs, 3 recompilations
        (2, 1, 32, 2),  # a higher one leaves the user's threshold alone
        (4, 1, 1, 1),  # no recompilation allowed at all: nothing to warn of, never 0
    ],
)
def test_the_threshold_stops_at_the_last_recompilation_dynamo_makes(
    recompile_warning: int, classes: int, limit: int, at: int
) -> None:
    assert warn_at(recompile_warning, classes, limit) == at


# --- which block class recompiles, and whether its instances differ ---------------------------


class Widen(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 2 * width)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


class Keep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Widen(4)  # a Widen inside another block

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x)


def _code(kind: type[nn.Module]) -> tuple[str, int]:
    code = kind.forward.__code__
    return code.co_filename, code.co_firstlineno


def test_the_recompiling_function_is_named_by_its_block_class() -> None:
    blocks = [Widen(4), Widen(8), Widen(4), Keep(), Keep()]
    assert recompiling_block(blocks, _code(Widen)) == Recompiling("Widen", 3, 2, ("Keep",))
    # Keep's instances are alike; a Widen only inside other blocks is counted there
    assert recompiling_block(blocks, _code(Keep)) == Recompiling("Keep", 2, 1, ("Widen",))
    assert recompiling_block([Keep(), Keep()], _code(Widen)) == Recompiling("Widen", 2, 1, ())
    assert recompiling_block(blocks, None) is None  # dynamo no longer records the function
    assert recompiling_block(blocks, ("elsewhere.py", 1)) is None


WIDEN = Recompiling("ResnetBlock2D", 12, 8, ("CLIPEncoderLayer", "Transformer2DModel"))
CHANNELS = "tensor 'input_tensor' size mismatch at index 1. expected 96, actual 64"


def test_instances_with_different_parameter_shapes_are_named_with_their_fixes() -> None:
    """A UNet's ResnetBlock2D: the batch is fixed, the channel counts are not."""
    advice = recompile_advice(
        7, 10, 12.34, CHANNELS, cache_called=False, dynamic=None, limit=8, block=WIDEN
    )
    assert advice == (
        "RegionalCompile: ResnetBlock2D's compiled forward recompiled 7 times (10 "
        "recompilations, 12.3 s compiling so far) (dynamo's last reason: "
        f"`{CHANNELS}`): its 12 instances have 8 different parameter shapes (channel counts "
        "that change with the place in the network), and dynamo compiles a graph for each: "
        "it keeps parameter shapes static, so neither `dynamic=True` nor fewer batch shapes "
        "helps; it now holds 8 graphs, dynamo's limit per function "
        "(`torch._dynamo.config.recompile_limit`): from now on its calls that fit none of them "
        "run uncompiled (instances not compiled yet, a new shape). Let dynamo keep more "
        "graphs, one or two per parameter shape: `torch._dynamo.config.recompile_limit = 16` "
        "before the fit; or compile only blocks whose instances share their shapes: "
        "`RegionalCompile(blocks=[CLIPEncoderLayer, Transformer2DModel])` leaves "
        "ResnetBlock2D out."
    )
    # the same with dynamic=True: the parameter shapes are still the cause
    assert (
        recompile_advice(
            7, 10, 12.34, CHANNELS, cache_called=False, dynamic=True, limit=8, block=WIDEN
        )
        == advice
    )


def test_alike_instances_are_not_blamed_on_their_parameter_shapes() -> None:
    alike = Recompiling("Block", 4, 1, ())
    advice = recompile_advice(5, 6, 12.34, SHAPE, cache_called=False, dynamic=None, block=alike)
    assert "parameter shapes" not in advice
    assert "batch shapes keep changing" in advice
    assert advice.startswith("RegionalCompile: Block's compiled forward recompiled 5 times")


def test_shapes_that_changed_only_in_the_first_step_are_blamed_on_the_position() -> None:
    advice = recompile_advice(
        5, 6, 12.34, SHAPE, cache_called=False, dynamic=False, first_step=True
    )
    assert advice == (
        f"{SAID} (dynamo's last reason: `{SHAPE}`): all within the first step, so not because "
        "batch shapes change: its instances get inputs of different shapes by their place in "
        "the network (a UNet's resolutions); past dynamo's limit (8) it runs uncompiled. "
        "Compile for symbolic shapes with `RegionalCompile(dynamic=True)`: one graph then "
        "serves them all. Length bucketing or sequence packing would not help."
    )


@pytest.mark.parametrize(("most", "full"), [(6, False), (7, True)])
def test_the_limit_is_the_one_torch_has_and_said_when_reached(most: int, full: bool) -> None:
    advice = recompile_advice(most, 9, 1.0, SHAPE, cache_called=False, dynamic=None, limit=8)
    assert ("it now holds 8 graphs, dynamo's limit per function" in advice) is full
    assert ("past dynamo's limit (8) it runs uncompiled" in advice) is not full
    lower = recompile_advice(3, 3, 1.0, SHAPE, cache_called=False, dynamic=None, limit=4)
    assert "it now holds 4 graphs" in lower
