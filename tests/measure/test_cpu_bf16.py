"""bf16 on a CPU that emulates it, on its own: when it applies, and the warning's fix."""

from __future__ import annotations

import pytest
import torch

from lightning_speedkit.measure import _cpu_bf16


@pytest.mark.parametrize(
    ("device", "precision", "native", "emulated"),
    [
        ("cpu", "bf16-mixed", False, True),
        ("cpu", "bf16-true", False, True),
        ("cpu", "bf16-mixed", True, False),
        ("cpu", "bf16-mixed", None, False),  # unknown: no warning
        ("cpu", "32-true", False, False),
        ("cuda", "bf16-mixed", False, False),
    ],
)
def test_emulated_bf16_needs_bf16_on_a_cpu_known_to_lack_it(
    device: str, precision: str, native: bool | None, emulated: bool
) -> None:
    got = _cpu_bf16.emulated_bf16(torch.device(device), precision, native=lambda: native)
    assert got is emulated


def test_by_default_it_asks_this_machines_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cpu_bf16, "cpu_native_bf16", lambda: False)
    assert _cpu_bf16.emulated_bf16(torch.device("cpu"), "bf16-mixed")


def test_the_message_names_the_precision_and_the_fix() -> None:
    message = _cpu_bf16.bf16_on_cpu_message("bf16-true")
    assert "trains in bf16-true on a CPU without native bf16" in message
    assert message.endswith("`Trainer(precision='32-true')`.")
