"""``speedkit plan --model`` on a LightningModule that builds its layers in ``configure_model``.

Lightning recommends ``configure_model`` for large models (sharded or meta-device
initialisation): exactly the models one plans memory for. Only ``__init__`` ran, so the
plan counted the parameters made there (none, or a stray embedding) and sized the memory
of a model that does not exist.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_speedkit.cli import main
from lightning_speedkit.cli._model_factory import count_parameters
from lightning_speedkit.cli._parser import CommandLineError

_MODULE = "speedkit_newuser_late_models"
_SOURCE = """
import lightning as L
import torch

class Late(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)  # 40, built at once
        self.blocks = None

    def configure_model(self):
        if self.blocks is not None:
            return
        self.blocks = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))  # 40
        self.blocks[1].requires_grad_(False)  # 20 frozen
        assert self.blocks[0].weight.is_meta

class Eager(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

class Broken(Late):
    def configure_model(self):
        raise RuntimeError("needs a GPU")
"""


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    (tmp_path / f"{_MODULE}.py").write_text(_SOURCE)
    monkeypatch.chdir(tmp_path)
    yield
    sys.modules.pop(_MODULE, None)


@pytest.mark.usefixtures("models")
def test_layers_built_in_configure_model_are_counted() -> None:
    assert count_parameters(f"{_MODULE}:Late") == (80, 60, " (after its configure_model)")
    assert count_parameters(f"{_MODULE}:Eager") == (20, 20, "")


@pytest.mark.usefixtures("models")
def test_a_configure_model_that_raises_is_one_line_naming_the_hook() -> None:
    said = r"argument --model: .*:Broken's configure_model\(\) raised RuntimeError: needs a GPU"
    with pytest.raises(CommandLineError, match=said + r" .*--params"):
        count_parameters(f"{_MODULE}:Broken")


@pytest.mark.usefixtures("models")
def test_the_plan_prints_the_counted_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", f"{_MODULE}:Late", "--gpus", "1"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (f"{_MODULE}:Late (after its configure_model): 80 parameters, 60 trainable")
