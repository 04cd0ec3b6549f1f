"""SwapReport: what swap_attention did, as lists, plain values and a table."""

from __future__ import annotations

from lightning_speedkit.attention import ModuleSwap, SwapReport


def _report() -> SwapReport:
    report = SwapReport("auto")
    report.modules = [
        ModuleSwap(
            "blocks.0.attn",
            "traced",
            "auto",
            backend="flash",
            status="active",
            parity_error=1.234e-5,
            speedup=2.5,
            checked="forward+backward",
            detail="4 heads",
            ranks="rank 1 picked 'math'",
        ),
        ModuleSwap("", "structural", "auto", status="reverted", reason="parity error 1.0e+00"),
        ModuleSwap("blocks.1.attn", "huggingface", "auto"),
    ]
    report.skipped = [("tower", "no SDPA path")]
    return report


def test_swapped_and_reverted_lists() -> None:
    report = _report()
    assert report.swapped == ["blocks.0.attn", "blocks.1.attn"]
    assert report.reverted == [("", "parity error 1.0e+00")]


def test_the_table_says_each_modules_decision() -> None:
    assert _report().to_markdown().splitlines() == [
        "| module | family | backend | status | parity error | speedup | note |",
        "|---|---|---|---|---|---|---|",
        "| blocks.0.attn | traced | flash | active | 1.2e-05 | 2.50x "
        "| checked: forward+backward; 4 heads; rank 1 picked 'math' |",
        "| (root) | structural | auto | reverted | - | - | parity error 1.0e+00 |",
        "| blocks.1.attn | huggingface | auto | pending | - | - | not called yet |",
        "| tower | - | - | skipped | - | - | no SDPA path |",
    ]
    assert str(_report()) == _report().to_markdown()


def test_as_dict_is_plain_values() -> None:
    as_dict = _report().as_dict()
    assert as_dict["backend"] == "auto"
    assert as_dict["skipped"] == [["tower", "no SDPA path"]]
    assert as_dict["modules"][1] == {
        "name": "",
        "family": "structural",
        "requested": "auto",
        "backend": None,
        "status": "reverted",
        "parity_error": None,
        "speedup": None,
        "checked": "",
        "reason": "parity error 1.0e+00",
        "packed_backend": None,
        "detail": "",
        "ranks": "",
    }
