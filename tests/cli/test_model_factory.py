"""``--model MODULE:FACTORY``: the user's model counted on the meta device, or one line."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_speedkit.cli._model_factory import count_parameters
from lightning_speedkit.cli._parser import CommandLineError

_MODULE = "speedkit_factory_models_xyz"
_SOURCE = """
import torch

class Tied(torch.nn.Module):
    def __init__(self, vocab=10, width=4):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)  # 40
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: counted once
        self.norm = torch.nn.LayerNorm(width)  # 8, frozen
        self.norm.requires_grad_(False)
        assert self.embed.weight.is_meta

class Zoo:
    @staticmethod
    def linear():
        return torch.nn.Linear(3, 2)

def not_a_model():
    return [1, 2]

def needs(width, depth=2):
    return torch.nn.Linear(width, width)

def lazy():
    from speedkit_factory_sibling_xyz import build  # beside this module, imported on call

    return build()
"""
_SIBLING = "speedkit_factory_sibling_xyz"


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A module of model factories in the current directory, as a user's would be."""
    (tmp_path / f"{_MODULE}.py").write_text(_SOURCE)
    (tmp_path / f"{_SIBLING}.py").write_text("import torch\ndef build():\n"
                                             "    return torch.nn.Linear(4, 4)\n")  # fmt: skip
    monkeypatch.chdir(tmp_path)
    path = list(sys.path)
    yield
    assert sys.path == path  # the current directory was added while the user's code ran only
    sys.modules.pop(_MODULE, None)
    sys.modules.pop(_SIBLING, None)


@pytest.mark.usefixtures("models")
def test_tied_parameters_count_once_and_frozen_ones_apart() -> None:
    assert count_parameters(f"{_MODULE}:Tied") == (48, 40, "")
    assert count_parameters(f"{_MODULE}:Zoo.linear") == (8, 8, "")  # a dotted attribute


@pytest.mark.usefixtures("models")
def test_a_factory_imports_a_module_beside_its_own_when_called() -> None:
    """As under `python -m`, the current directory is still on the path as the factory
    runs (it was taken off after the import: "No module named 'speedkit_factory_sibling_xyz'")."""
    assert count_parameters(f"{_MODULE}:lazy") == (20, 20, "")  # a Linear(4, 4)


def test_the_example_vlm_is_built_with_its_default_config() -> None:
    from speedkit_examples.vlm import VLM, CaptionTokenizer, VLMConfig

    model = VLM(VLMConfig(vocab_size=CaptionTokenizer().vocab_size))
    params = sum(p.numel() for p in model.parameters())
    assert count_parameters("speedkit_examples.vlm:VLM") == (
        params, params, " (VLMConfig's defaults)",
    )  # fmt: skip


@pytest.mark.usefixtures("models")
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (f"{_MODULE}:not_a_model",
         f"argument --model: {_MODULE}:not_a_model returned a list, not a torch.nn.Module"),
        (f"{_MODULE}:needs",
         f"argument --model: {_MODULE}:needs needs arguments (width); name a function that "
         "builds the model without any, e.g. `def build(): return MyModel(MyConfig())`, as "
         "--model MODULE:build"),
        (f"{_MODULE}:Zoo.missing",
         f"argument --model: {_MODULE} has no function or class 'Zoo.missing' (from "
         f"'{_MODULE}:Zoo.missing')"),
        (f"{_MODULE}:", "argument --model: expected MODULE:FACTORY, e.g. "
         f"speedkit_examples.vlm:VLM, got '{_MODULE}:'"),
    ],
)  # fmt: skip
def test_what_cannot_give_a_model_is_one_line_naming_it(spec: str, message: str) -> None:
    with pytest.raises(CommandLineError) as info:
        count_parameters(spec)
    assert str(info.value) == message
