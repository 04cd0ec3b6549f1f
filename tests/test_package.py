from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_speedkit
from lightning_speedkit import _versions
from tests.helpers.multiprocess import REPO, clean_env

#: Standard-library modules that exist on Linux and macOS but not on Windows.
POSIX_ONLY = ("resource", "fcntl", "termios", "pwd", "grp", "pty", "tty", "syslog")


def test_package_is_typed_and_versioned() -> None:
    root = Path(lightning_speedkit.__file__).parent
    assert (root / "py.typed").exists()
    assert lightning_speedkit.__version__.startswith("0.")
    assert "__version__" in lightning_speedkit.__all__


def _kit_entries() -> dict[str, tuple[object, str, dict[str, object]]]:
    return {
        name: (entry["strategy"], entry["description"], dict(entry["init_params"]))
        for name, entry in StrategyRegistry.items()
        if entry["strategy"].__module__.startswith("lightning_speedkit.")
    }


def test_reimport_registers_each_strategy_name_once() -> None:
    before = _kit_entries()
    names = set(StrategyRegistry)
    assert {
        "ddp_powersgd",
        "ddp_fp16_compress",
        "ddp_bf16_compress",
        "fsdp_zero2",
        "fsdp2_zero2",
    } <= set(before)
    assert {"deepspeed_zero2", "deepspeed_zero2_offload"} <= set(before)
    importlib.reload(lightning_speedkit)  # raised "already present in the registry" before
    importlib.reload(lightning_speedkit)
    assert set(StrategyRegistry) == names
    assert _kit_entries() == before
    trainer = L.Trainer(strategy="ddp_bf16_compress", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, lightning_speedkit.DDPHalfPrecisionStrategy)
    assert trainer.strategy.compress_dtype == "bf16"  # the name's parameters kept


_IMPORT_CHECKS = """
import json, sys
import lightning
out = {}
real = lightning.__version__
lightning.__version__ = "2.5.5"
try:
    import lightning_speedkit
    out["old_lightning"] = "imported"
except ImportError as err:
    out["old_lightning"] = str(err)
lightning.__version__ = real
for name in sys.argv[1:]:
    sys.modules[name] = None  # as on Windows: importing it raises ImportError
import lightning_speedkit
from lightning.pytorch.strategies import StrategyRegistry
from lightning_speedkit.measure._host_memory import host_memory_bytes
out["strategy"] = StrategyRegistry["ddp_powersgd"]["strategy"].__name__
out["host_memory"] = host_memory_bytes()
print(json.dumps(out))
"""


def test_imports_without_posix_only_modules_and_refuses_an_old_lightning(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECKS, *POSIX_ONLY],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["old_lightning"].startswith(
        "lightning_speedkit needs lightning>=2.6, found lightning 2.5.5. Upgrade it: "
        "pip install 'lightning>=2.6'"
    )
    assert out["strategy"] == "DDPPowerSGDStrategy"
    assert out["host_memory"] > 10 * 2**20  # Linux's /proc needs no resource module


@pytest.mark.parametrize(
    ("torch_version", "lightning_version", "refused"),
    [
        ("2.13.0+cpu", "2.6.6", None),
        ("2.11.0+cu130", "2.6.0", None),
        ("2.11.0a0+git1234", "2.6.0rc1", None),  # a pre-release counts as its release
        ("3.0.0", "3.1", None),
        ("unknown", "", None),  # unreadable: let through
        ("2.10.1", "2.6.6", "torch>=2.11, found torch 2.10.1"),
        ("2.13.0", "2.5.5", "lightning>=2.6, found lightning 2.5.5"),
        ("1.13.1", "1.9.5", "torch>=2.11, found torch 1.13.1"),
    ],
)
def test_version_floor(torch_version: str, lightning_version: str, refused: str | None) -> None:
    if refused is None:
        _versions.check_versions(torch_version, lightning_version)
    else:
        with pytest.raises(ImportError, match=refused.replace("+", r"\+")):
            _versions.check_versions(torch_version, lightning_version)


def test_floors_agree_with_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    floors = {
        req.split(">=")[0]: req.split(">=")[1] for req in project["dependencies"] if ">=" in req
    }
    assert floors["torch"] == ".".join(map(str, _versions.TORCH_FLOOR))
    assert floors["lightning"] == ".".join(map(str, _versions.LIGHTNING_FLOOR))


def test_every_trainer_free_core_is_importable_from_the_package() -> None:
    """Each callback is a thin layer over a function a user can call without a Trainer."""
    from lightning_speedkit.compute import (
        cache_frozen_features,
        compile_blocks,
        fuse_optimizers,
        tune_micro_batch,
    )
    from lightning_speedkit.distributed import checkpoint_blocks

    cores = {
        "count_flops": lightning_speedkit.measure.count_flops,
        "peak_flops": lightning_speedkit.measure.peak_flops,
        "tune_num_workers": lightning_speedkit.data.tune_num_workers,
        "swap_attention": lightning_speedkit.attention.swap_attention,
        "plan_memory": lightning_speedkit.distributed.plan_memory,
        "tune_micro_batch": tune_micro_batch,
        "compile_blocks": compile_blocks,
        "checkpoint_blocks": checkpoint_blocks,
        "fuse_optimizers": fuse_optimizers,
        "cache_frozen_features": cache_frozen_features,
    }
    for name, function in cores.items():
        assert name in lightning_speedkit.__all__
        assert getattr(lightning_speedkit, name) is function
        assert "Example::" in (function.__doc__ or ""), f"{name} has no runnable example"
