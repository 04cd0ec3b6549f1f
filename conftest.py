"""Shared by every test the suite collects, the package's doctests included."""

from __future__ import annotations

import gc
import importlib.util

import pytest
from _pytest.doctest import DoctestItem


def pytest_configure() -> None:
    """DeepSpeed prints its accelerator choice to stdout when first imported in a process;
    a doctest that happened to import it first would read that as the example's output.
    Imported here, the line goes to pytest's captured output of the session."""
    if importlib.util.find_spec("deepspeed") is not None:
        import deepspeed  # noqa: F401


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """A doctest that builds an FSDP model leaves, once its namespace is cleared, the
    model's gloo process group in reference cycles, with the group's threads running.
    Collected here, where those threads are; left for later, a DataLoader worker forked
    by another test could collect it and hang in its destructor (docs/data.md)."""
    if isinstance(item, DoctestItem) and "init_process_group" in (item.dtest.docstring or ""):
        gc.collect()
