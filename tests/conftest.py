"""Shared fixtures and the skip rules for optional hardware and packages."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_speedkit.data.worker_search import cpu_budget
from speedkit_examples.vlm import CorpusConfig, ensure_corpus

#: A corpus small enough to build in a fraction of a second, for data-path tests.
SMALL_CORPUS = CorpusConfig(train_samples=96, val_samples=32, samples_per_shard=32)

_SKIPS = {
    "gpu": (lambda: torch.cuda.is_available(), "needs a CUDA device"),
    "deepspeed": (
        lambda: importlib.util.find_spec("deepspeed") is not None,
        "needs deepspeed: pip install 'lightning_speedkit[deepspeed]'",
    ),
    "xformers": (
        lambda: importlib.util.find_spec("xformers") is not None,
        "needs xformers: pip install 'lightning_speedkit[xformers]'",
    ),
    "flash_attn": (
        lambda: torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None,
        "needs flash-attn and a CUDA device (pip install 'lightning_speedkit[flash]' there)",
    ),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    available = {name: check() for name, (check, _) in _SKIPS.items()}
    for item in items:
        for name, (_, reason) in _SKIPS.items():
            if item.get_closest_marker(name) and not available[name]:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Caches (corpus, tuner results) go to a temporary directory, not the user's ~/.cache.

    DeepSpeed's CPU op, which it compiles with g++ on first use (about 25 s), is kept in
    the test environment instead, so one build serves every test and every later run.
    """
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


@pytest.fixture(scope="session", autouse=True)
def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist, each test process computes on its share of the cores.

    torch starts one thread per core in every process; two test processes on two cores
    then run four busy threads, and a training test took six times as long beside the
    other process as alone. Tests that depend on the thread count set it themselves.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(cpu_budget(workers))


@pytest.fixture(autouse=True)
def _torch_threads() -> Iterator[None]:
    """Each test starts with the process's torch thread count, whatever the last one set.

    Benchmarks run in-process by their tests set it (``--threads``); a later test whose
    behaviour depends on it (NumWorkersTuner gives loader workers the cores torch's
    threads leave free) would otherwise see a different machine.
    """
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Directory holding :data:`SMALL_CORPUS`: pass it as ``data_dir``, with that ``corpus=``.

    A test that forgets ``corpus=`` writes the default corpus beside it, and tests that read
    "the" corpus in this directory then see two: the teardown names that mistake.
    """
    data_dir = tmp_path_factory.mktemp("small-corpus")
    ensure_corpus(data_dir, SMALL_CORPUS, progress=False)
    yield data_dir
    corpora = sorted(p.name for p in data_dir.glob("corpus-*"))
    assert len(corpora) == 1, f"a test wrote another corpus into the shared small_corpus: {corpora}"


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory holding the default (demo) corpus, built once per session."""
    data_dir = tmp_path_factory.mktemp("demo-corpus")
    ensure_corpus(data_dir, progress=False)
    return data_dir


@pytest.fixture(autouse=True)
def _peaks_found_anew() -> None:
    """SpeedMonitor keeps the peak it found for the rest of the process; a test that
    patches how it is found must not hand its figure to the tests after it."""
    from lightning_speedkit.measure import speed_monitor

    speed_monitor._TIMED_PEAKS.clear()


@pytest.fixture(autouse=True)
def _no_packed_hooks_left() -> Iterator[None]:
    """A test that packs without a Trainer (``packed_documents``) leaves the packed
    batches' global module hooks registered; the next test in this process starts
    without them, as a fresh process would (AttentionSwap removes them when its fit ends)."""
    yield
    from lightning_speedkit.attention._own_calls import remove_model_hooks

    remove_model_hooks()


@pytest.fixture(autouse=True)
def _auto_keeps_its_swaps_whatever_the_load(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` keeps a module's own forward where it timed that clearly faster: a verdict
    of the wall clock, which a loaded machine can turn. A test that does not drive that
    clock keeps every swap, so none depends on the machine's load; the tests of the
    verdict (marked ``own_timing``) drive the clock and keep the margin."""
    if request.node.get_closest_marker("own_timing") is None:
        from lightning_speedkit.attention import _auto_timing

        monkeypatch.setattr(_auto_timing, "OWN_FASTER_BELOW", 0.0)
