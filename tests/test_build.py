"""The wheel and the sdist hold the whole package and work without the source tree.

An editable install (what the tests otherwise run against) reads the source tree,
so a subpackage missing from the packaging would pass every other test and fail for
every user: this builds both distributions as a release would, installs each into an
empty directory and imports and runs it from there.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from lightning_speedkit import __version__

REPO = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("attention", "data", "distributed", "measure", "schedule")


def _run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, check=False,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # From a copy of what a release holds: setuptools reuses a tree's build/ directory,
    # where modules of an earlier build would hide a packaging mistake.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("lightning_speedkit", "examples"):
        shutil.copytree(REPO / name, source / name, ignore=skip)
    out = tmp_path_factory.mktemp("dist")
    # No isolation: the build backend (setuptools) of this environment, no download.
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source),
         cwd=out)  # fmt: skip
    return out


def test_wheel_and_sdist_hold_every_module(dist: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    assert __version__ in wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(REPO).as_posix() for p in (REPO / "lightning_speedkit").rglob("*.py")}
    assert sources <= names
    assert "lightning_speedkit/py.typed" in names
    examples = {"speedkit_examples/" + p.relative_to(REPO / "examples").as_posix()
                for p in (REPO / "examples").rglob("*.py")}  # fmt: skip
    assert examples <= names
    with tarfile.open(sdist) as archive:
        members = {m.split("/", 1)[1] for m in archive.getnames() if "/" in m}
    assert sources <= members


@pytest.mark.parametrize("kind", ["whl", "tar.gz"])
def test_installed_distribution_imports_and_runs_without_the_source_tree(
    dist: Path, tmp_path: Path, kind: str
) -> None:
    (artifact,) = dist.glob(f"*.{kind}")
    target = tmp_path / "site"
    # Dependencies (torch, lightning) come from this environment; the package from the
    # artifact alone (an sdist is built into a wheel on the way, as pip does).
    _run(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(artifact), cwd=tmp_path)  # fmt: skip
    code = (
        "import lightning_speedkit, speedkit_examples.vlm, sys;"
        "from lightning_speedkit.measure.report import analyze_trace;"
        "from lightning_speedkit.cli import main;"
        "where = lightning_speedkit.__file__;"
        f"assert where.startswith({str(target)!r}), where;"
        "sys.exit(main(['plan', '--params', '7e9', '--gpus', '8', '--gpu-mem', '80']))"
    )  # fmt: skip
    # -S: no site processing, so the editable install's finder (a .pth hook) is not there
    # to fill in what the artifact lacks; the dependencies come from site-packages.
    site_packages = sysconfig.get_paths()["purelib"]
    env = {"PYTHONPATH": f"{target}:{site_packages}", "PATH": "/usr/bin:/bin"}
    out = _run(sys.executable, "-S", "-c", code, cwd=tmp_path, env=env)
    assert "recommended:" in out
