"""``speedkit``: one module per subcommand, dispatched by name, refusals in its flags."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from lightning_speedkit import __version__
from lightning_speedkit.cli import _COMMANDS, build_parser, main


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions if a.dest == "command"]
    return dict(action.choices)  # type: ignore[arg-type]


def test_each_subcommand_module_is_the_parser_of_its_name() -> None:
    parsers = _subparsers()
    assert list(parsers) == ["demo", "bench-allreduce", "bench-attention", "plan", "report"]
    assert sorted(_COMMANDS) == sorted(parsers)
    for name, command in _COMMANDS.items():
        assert name == command.NAME
        assert parsers[name].prog == f"speedkit {name}"


@pytest.mark.parametrize("name", ["demo", "bench-allreduce", "bench-attention", "plan", "report"])
def test_every_flag_the_kits_errors_are_translated_to_exists(name: str) -> None:
    """A FLAGS entry naming a flag the subcommand lacks would tell the user to type it."""
    options = {o for action in _subparsers()[name]._actions for o in action.option_strings}
    assert set(_COMMANDS[name].FLAGS.values()) <= options


def test_the_kits_refusal_is_said_in_the_flags_of_the_command_that_ran(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_speedkit import SpeedkitConfigError
    from lightning_speedkit.cli import plan

    def refuse(args: argparse.Namespace) -> int:
        raise SpeedkitConfigError("`n_devices` must be at least 1,\n  got 0; and `kv_heads`.")

    monkeypatch.setattr(plan, "run", refuse)
    assert main(["plan", "--params", "1e9", "--gpus", "2"]) == 2
    assert capsys.readouterr().err == (
        "speedkit plan: error: `--gpus` must be at least 1, got 0; and `kv_heads`.\n"
    )  # plan's flags only: kv_heads is bench-attention's


def test_python_dash_m_runs_the_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_speedkit.cli", "--version"],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert (proc.returncode, proc.stdout.strip()) == (0, f"speedkit {__version__}")
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_speedkit.cli", "plan", "--gpus", "0"],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].startswith("speedkit plan: error: argument --gpus")
