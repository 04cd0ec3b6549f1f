"""Strategy names from a LightningCLI, in a fresh interpreter where nothing imported the kit yet.

In this test session lightning_speedkit is long imported, so its names are registered
whatever the code under test does: each check runs in its own interpreter, builds the
CLI with ``run=False`` (parse, instantiate the Trainer, no fit) and prints what it got.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.helpers.multiprocess import REPO, clean_env

CONFIG = REPO / "examples" / "vlm" / "speedkit.yaml"

_BASE = """
import json, sys
BASE = ["--trainer.accelerator", "cpu", "--trainer.devices", "1",
        "--trainer.default_root_dir", sys.argv[1], "--model.config.vocab_size", "35",
        "--model.config.image_size", "32", "--model.config.max_text_len", "40"]
def strategy_of(cli):
    s = cli.trainer.strategy
    return [type(s).__module__ + "." + type(s).__qualname__, getattr(s, "rank", None),
            getattr(s, "compress_dtype", None)]
"""

_PLAIN_CLI = (
    _BASE
    + """
from lightning.pytorch.cli import LightningCLI
from speedkit_examples.vlm import VLMDataModule, VLMTask
def build(*args):
    return LightningCLI(VLMTask, VLMDataModule, args=[*BASE, *args], run=False)
out = {"kit_imported_first": "lightning_speedkit" in sys.modules}
try:
    build("--trainer.strategy", "ddp_powersgd")
    out["name"] = "built"
except ValueError as err:
    out["name"] = str(err)
out["kit_imported_by_name"] = "lightning_speedkit" in sys.modules
path = {"class_path": "lightning_speedkit.DDPPowerSGDStrategy", "init_args": {"rank": 4}}
out["class_path"] = strategy_of(build("--trainer.strategy", json.dumps(path)))
from importlib.util import find_spec
deepspeed = ["DeepSpeedZeRO2Strategy"] if find_spec("deepspeed") else []
for name in ("DDPHalfPrecisionStrategy", "FSDPZeRO2Strategy", *deepspeed):
    path = {"class_path": "lightning_speedkit." + name}
    out[name] = strategy_of(build("--trainer.strategy", json.dumps(path)))
out["name_after"] = strategy_of(build("--trainer.strategy", "ddp_bf16_compress"))
print(json.dumps(out))
"""
)

_EXAMPLE_CLI = (
    _BASE
    + """
from speedkit_examples.vlm.cli import main
out = {"flag": strategy_of(main([*BASE, "--trainer.strategy", "ddp_powersgd"], run=False))}
cli = main(["--config", sys.argv[2], "--trainer.devices", "1",
            "--trainer.default_root_dir", sys.argv[1]], run=False)
out["yaml"] = strategy_of(cli)
out["yaml_callbacks"] = sorted({type(c).__module__.split(".")[0] for c in cli.trainer.callbacks})
print(json.dumps(out))
"""
)

POWERSGD = "lightning_speedkit.distributed.powersgd.DDPPowerSGDStrategy"


def _run(script: str, *args: str, cwd: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_example_cli_takes_the_name_from_a_flag_and_from_a_yaml_without_kit_callbacks(
    tmp_path: Path,
) -> None:
    config = yaml.safe_load(CONFIG.read_text())
    # the shipped config asks for rank 4 (its model trains with AdamW) by class path
    assert config["trainer"]["strategy"] == {
        "class_path": "lightning_speedkit.DDPPowerSGDStrategy",
        "init_args": {"rank": 4},
    }
    config["trainer"]["strategy"] = "ddp_powersgd"  # the registered name, in a yaml
    del config["trainer"]["callbacks"]  # nothing left in the config imports the kit
    bare = tmp_path / "no-callbacks.yaml"
    bare.write_text(yaml.safe_dump(config))
    out = _run(_EXAMPLE_CLI, str(tmp_path), str(bare), cwd=tmp_path)
    assert out["flag"] == [POWERSGD, 1, None]  # the registered name's defaults
    assert out["yaml"] == [POWERSGD, 1, None]
    assert "lightning_speedkit" not in out["yaml_callbacks"]  # Lightning's own callbacks only


def test_plain_lightning_cli_needs_the_import_or_a_class_path(tmp_path: Path) -> None:
    """What Lightning allows, as docs/distributed.md says: names need the kit imported first."""
    out = _run(_PLAIN_CLI, str(tmp_path), cwd=tmp_path)
    assert out["kit_imported_first"] is False
    assert "invalid strategy name" in out["name"]  # Lightning loads nothing to resolve it
    assert out["kit_imported_by_name"] is False
    # A class path needs no import: jsonargparse imports the class while parsing
    assert out["class_path"] == [POWERSGD, 4, None]
    assert out["DDPHalfPrecisionStrategy"] == [
        "lightning_speedkit.distributed.half_precision.DDPHalfPrecisionStrategy",
        None,
        "fp16",
    ]
    assert out["FSDPZeRO2Strategy"][0].endswith("fsdp_zero2.FSDPZeRO2Strategy")
    if importlib.util.find_spec("deepspeed") is not None:
        deepspeed = out["DeepSpeedZeRO2Strategy"][0]
        assert deepspeed.endswith("deepspeed_zero2.DeepSpeedZeRO2Strategy")
    # ... and from then on (the kit is imported) every name works
    assert out["name_after"] == [
        "lightning_speedkit.distributed.half_precision.DDPHalfPrecisionStrategy",
        None,
        "bf16",
    ]
