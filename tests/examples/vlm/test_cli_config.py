"""The example's LightningCLI config turns on every callback and a speedkit strategy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import lightning_speedkit
from speedkit_examples.vlm.cli import main
from tests.helpers.multiprocess import REPO, clean_env

from ...conftest import SMALL_CORPUS

CONFIG = REPO / "examples" / "vlm" / "speedkit.yaml"
CALLBACKS = (
    lightning_speedkit.SpeedMonitor,
    lightning_speedkit.NumWorkersTuner,
    lightning_speedkit.AttentionSwap,
    lightning_speedkit.AccumulationScheduler,
    lightning_speedkit.ActivationCheckpointing,
    lightning_speedkit.ProfilerSchedule,
)


def test_config_builds_every_callback_and_the_strategy(tmp_path: Path) -> None:
    cli = main(["--config", str(CONFIG), "--trainer.devices", "1",
                "--trainer.default_root_dir", str(tmp_path)], run=False)  # fmt: skip
    for kind in CALLBACKS:
        assert sum(isinstance(c, kind) for c in cli.trainer.callbacks) == 1, kind
    assert isinstance(cli.trainer.strategy, lightning_speedkit.DDPPowerSGDStrategy)


@pytest.mark.multiprocess
def test_config_trains_on_two_processes(small_corpus: Path, tmp_path: Path) -> None:
    args = [sys.executable, "-m", "speedkit_examples.vlm.cli", "fit", "--config", str(CONFIG),
            "--trainer.max_steps", "3", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--data.data_dir", str(small_corpus), "--data.batch_size", "8",
            # the corpus the fixture built: another would be generated into the shared dir
            "--data.corpus.train_samples", str(SMALL_CORPUS.train_samples),
            "--data.corpus.val_samples", str(SMALL_CORPUS.val_samples),
            "--data.corpus.samples_per_shard", str(SMALL_CORPUS.samples_per_shard),
            "--trainer.limit_val_batches", "0",
            "--trainer.enable_progress_bar", "false"]  # fmt: skip
    # ProfilerSchedule's window within 3 optimizer steps (6 micro-batches)
    config = tmp_path / "short.yaml"
    config.write_text(CONFIG.read_text().replace("skip_first: 20", "skip_first: 1\n        wait: 0")
                      .replace("target_global_batch: 128", "target_global_batch: 32")
                      .replace("micro_batch_size: 32", "micro_batch_size: 8"))  # fmt: skip
    args[args.index(str(CONFIG))] = str(config)
    env = {**clean_env(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    reports = sorted(p.name for p in tmp_path.rglob("speedkit_report*.md"))
    assert reports == ["speedkit_report-rank1.md", "speedkit_report.md"]
    assert [p.name for p in tmp_path.rglob("*.ckpt")] == ["epoch=0-step=3.ckpt"]
    assert len(list(small_corpus.glob("corpus-*"))) == 1  # trained on the fixture's corpus
