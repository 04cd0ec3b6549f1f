"""Shared by every test the suite collects, the package's doctests included."""

from __future__ import annotations

import importlib.util


def pytest_configure() -> None:
    """DeepSpeed prints its accelerator choice to stdout when first imported in a process;
    a doctest that happened to import it first would read that as the example's output.
    Imported here, the line goes to pytest's captured output of the session."""
    if importlib.util.find_spec("deepspeed") is not None:
        import deepspeed  # noqa: F401
