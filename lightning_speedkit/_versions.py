"""The oldest torch and Lightning the kit runs on, checked once when it is imported.

The same floors are in ``pyproject.toml``; an environment that bypassed them (an
install with ``--no-deps``, a torch built from source, a conda environment) gets a
message naming what to upgrade instead of an error deep inside Lightning's
internals, which the kit reads (see ``_compat``) and which change between
Lightning releases.

Tested: the test suite with torch 2.13.0 (CPU) and Lightning 2.6.6; the demo and
benchmarks on an H100 with torch 2.11.0 (CUDA 13.0) and Lightning 2.6.6.
"""

from __future__ import annotations

import re

#: The oldest torch the kit runs on (major, minor).
TORCH_FLOOR = (2, 11)
#: The oldest Lightning the kit runs on (major, minor).
LIGHTNING_FLOOR = (2, 6)


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string; None when it does not start with them.

    Pre-releases and local builds count as their release: ``2.11.0a0+git1234`` is 2.11.

    Example::

        >>> release("2.11.0+cu130"), release("2.6.0rc1"), release("unknown")
        ((2, 11), (2, 6), None)
    """
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def check_versions(torch_version: str, lightning_version: str) -> None:
    """Raise ImportError naming the upgrade when torch or Lightning is older than the floor.

    A version that cannot be read (a build without one) is let through.

    Example::

        >>> check_versions("2.13.0+cpu", "2.6.6")
        >>> check_versions("2.13.0", "2.5.5")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ImportError: lightning_speedkit needs lightning>=2.6, found lightning 2.5.5. ...
    """
    for name, found, floor in (
        ("torch", torch_version, TORCH_FLOOR),
        ("lightning", lightning_version, LIGHTNING_FLOOR),
    ):
        have = release(found)
        if have is not None and have < floor:
            need = ".".join(map(str, floor))
            raise ImportError(
                f"lightning_speedkit needs {name}>={need}, found {name} {found}. Upgrade "
                f"it: pip install '{name}>={need}' (for torch, pick the build for your CUDA "
                f"version or the CPU first, as the kit's Getting started page says)."
            )


def _check_installed() -> None:
    import lightning
    import torch

    check_versions(torch.__version__, lightning.__version__)


_check_installed()
