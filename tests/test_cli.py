from __future__ import annotations

import contextlib
import json
import logging
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest

from lightning_speedkit import __version__
from lightning_speedkit._demo import DemoResult, _KitVLMData, _quiet_third_party, time_per_sample
from lightning_speedkit.cli import build_parser, main
from lightning_speedkit.data import SampleCache

from .conftest import SMALL_CORPUS


def _subcommands() -> list[str]:
    parser = build_parser()
    (action,) = [a for a in parser._actions if a.dest == "command"]
    return sorted(action.choices)  # type: ignore[arg-type]


def test_help_lists_only_subcommands_that_exist(capsys: pytest.CaptureFixture[str]) -> None:
    assert _subcommands() == ["bench-allreduce", "bench-attention", "demo", "plan", "report"]
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "demo" in out
    assert "plan" in out
    assert "report" in out


def test_plan_prints_the_table_and_recommends(capsys: pytest.CaptureFixture[str]) -> None:
    shape = ["--seq", "4096", "--batch", "1", "--hidden", "4096", "--layers", "32"]
    code = main(["plan", "--params", "7e9", "--gpus", "8", "--gpu-mem", "80", *shape,
                 "--fused-attention"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    ddp = next(line for line in out.splitlines() if line.startswith("ddp "))
    assert ddp.split()[1:5] == ["13.04", "13.04", "78.23", "104.31"]  # 2 + 2 + 12 bytes x 7e9
    assert ddp.split()[-1] == "no"
    assert "recommended: Trainer(strategy='fsdp_zero2')" in out


def test_plan_counts_a_real_model_and_says_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    model = "tests.distributed.test_plan_memory:small_vlm_frozen_vision"
    assert main(["plan", "--model", model, "--gpus", "2", "--gpu-mem", "1"]) == 0
    out = capsys.readouterr().out
    assert "trainable" in out
    assert "recommended: Trainer(strategy='ddp')" in out
    assert main(["plan", "--model", "not_a_module_xyz:f", "--gpus", "2"]) == 2
    assert "speedkit plan: error:" in capsys.readouterr().err
    assert main(["plan", "--params", "1e12", "--gpus", "2", "--gpu-mem", "1"]) == 0
    assert "nothing fits" in capsys.readouterr().out


def test_plan_on_cpu_counts_single_tensor_adams_temporaries(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lightning_speedkit.distributed import plan_memory

    args = ["plan", "--params", "1e9", "--gpus", "2", "--precision", "fp32"]
    totals = {}
    for device in ("cuda", "cpu"):
        assert main([*args, "--device", device]) == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("deepspeed_zero2 "))
        totals[device] = float(row.split()[6])
        planned = plan_memory(1e9, 2, precision="fp32", device=device)
        assert totals[device] == pytest.approx(
            planned.per_device("deepspeed_zero2").total / 2**30, abs=0.01
        )
    # One flat partition of 5e8 fp32 parameters: two whole-partition temporaries on CPU
    # (8 bytes each), one on CUDA (4 bytes): 2 GB apart, 1.86 GiB.
    assert totals["cpu"] - totals["cuda"] == pytest.approx(2e9 / 2**30, abs=0.02)
    with pytest.raises(SystemExit):
        main([*args, "--device", "gpu"])
    assert "invalid choice: 'gpu'" in capsys.readouterr().err


def test_console_script_is_installed() -> None:
    exe = shutil.which("speedkit", path=str(Path(sys.executable).parent))
    assert exe is not None
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == f"speedkit {__version__}"


@pytest.mark.parametrize("flag", ["--steps", "--batch-size", "--devices", "--global-batch"])
def test_demo_refuses_non_positive_counts(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", flag, "0"])
    assert info.value.code == 2
    assert f"argument {flag}: must be a positive integer, got 0" in capsys.readouterr().err


def test_demo_trains_plain_and_kit_and_prints_them_side_by_side(
    demo_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["demo", "--steps", "40", "--data-dir", str(demo_corpus),
                 "--output-dir", str(tmp_path), "--accelerator", "cpu"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "plain" in line)
    assert header.split() == ["plain", "kit"]
    for row in ("samples/s", "MFU", "data wait (share of step)", "step time p99 (ms)",
                "peak memory (GiB)", "train loss, first steps", "train loss, last steps",
                "held-out token accuracy"):  # fmt: skip
        assert row in out
    assert "kit / plain samples/s:" in out
    if "NumWorkersTuner chose num_workers=0" in out:  # loading in-process: cached
        assert "kit: SampleCache: decoded samples kept after their first read" in out
    else:
        assert "kit: SampleCache left off: the tuned loader decodes in worker processes" in out
    plain, kit = json.loads((tmp_path / "demo.json").read_text())
    assert (plain["run"], kit["run"]) == ("plain", "kit")
    for result in (plain, kit):
        assert result["steps"] == 40
        assert result["devices"] == 1
        assert result["samples_per_sec"] > 0
        assert 0 < result["step_ms_p50"] <= result["step_ms_p90"]
        assert result["loss_end"] < 0.7 * result["loss_start"]
        assert 0 < result["mfu"] < 1  # against a matmul measured on this CPU
        assert 0 <= result["data_wait_frac"] < 1
    assert f"{plain['samples_per_sec']:,.1f}" in out
    ratio = kit["samples_per_sec"] / plain["samples_per_sec"]
    assert f"kit / plain samples/s: {ratio:.2f}x" in out
    for result in (plain, kit):  # µs per sample: data wait + compute
        total = 1e6 / result["samples_per_sec"]
        data = total * result["data_wait_frac"]
        assert f"{total:>7,.0f} = {data:>6,.0f} + {total - data:>7,.0f}" in out


def test_demo_on_two_processes_compresses_the_kits_gradients_with_powersgd(
    demo_corpus: Path, tmp_path: Path
) -> None:
    # Lightning's launcher re-runs the command line in the second process: a subprocess.
    exe = shutil.which("speedkit", path=str(Path(sys.executable).parent))
    assert exe is not None
    steps = 110  # PowerSGD compresses from step 100 (start_iter)
    proc = subprocess.run(
        [exe, "demo", "--devices", "2", "--steps", str(steps), "--batch-size", "8",
         "--data-dir", str(demo_corpus), "--output-dir", str(tmp_path),
         "--accelerator", "cpu"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain, kit = json.loads((tmp_path / "demo.json").read_text())
    assert (plain["devices"], kit["devices"]) == (2, 2)
    assert plain["steps"] == kit["steps"] == steps
    note = next(n for n in kit["notes"] if "PowerSGD" in n)
    assert "at rank 4" in note
    ratio = float(note.split(", ")[1].split("x fewer elements sent")[0])
    assert ratio > 2  # the tiny VLM's matrices (64 x 64 and up) really were compressed
    assert not any("PowerSGD" in n for n in plain["notes"])  # plain DDP, uncompressed


def test_demo_output_leaves_out_what_its_user_cannot_act_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from torch.utils._pytree import LeafSpec

    def trainer_start() -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
        return [record.getMessage() for record in caplog.records]

    def leaf_spec_warnings(quiet: bool) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with _quiet_third_party() if quiet else contextlib.nullcontext():
                LeafSpec()  # what Lightning's tree flattening does, and torch deprecates
        return [str(w.message) for w in seen if "LeafSpec" in str(w.message)]

    assert any("litlogger" in message for message in trainer_start())  # Lightning's tip
    assert leaf_spec_warnings(quiet=False)
    assert not leaf_spec_warnings(quiet=True)
    with _quiet_third_party():
        messages = trainer_start()
        assert not any("litlogger" in message for message in messages)
        assert any("GPU available" in message for message in messages)  # the rest stays
    assert any("litlogger" in message for message in trainer_start())  # filter removed


def test_time_per_sample_splits_data_wait_from_compute() -> None:
    figures: dict[str, Any] = dict(
        run="plain", notes=[], size="tiny", params=1, devices=1, steps=1, mfu=None,
        step_ms_p50=None, step_ms_p90=None, step_ms_p99=None, mem_peak_gib=None,
        loss_start=1.0, loss_end=1.0, val_loss=1.0, val_acc=0.5, wall_sec=1.0,
    )  # fmt: skip
    run = DemoResult(samples_per_sec=800.0, data_wait_frac=0.25, **figures)
    assert time_per_sample(run) == pytest.approx((1250.0, 312.5, 937.5))
    unknown = DemoResult(samples_per_sec=800.0, data_wait_frac=None, **figures)
    assert time_per_sample(unknown) is None


def test_demo_global_batch_accumulates_in_both_runs(
    demo_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["demo", "--steps", "4", "--batch-size", "8", "--global-batch", "32",
                 "--data-dir", str(demo_corpus), "--output-dir", str(tmp_path),
                 "--accelerator", "cpu"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "plain: accumulate_grad_batches: 4 batches of 8 on 1 device(s) per optimizer" in out
    assert "kit: AccumulationScheduler: 4 batches of 8 on 1 device(s) per optimizer" in out
    plain, kit = json.loads((tmp_path / "demo.json").read_text())
    assert plain["steps"] == kit["steps"] == 4
    # the same optimisation: four micro-batches of the same data per step in both runs
    assert kit["loss_start"] == pytest.approx(plain["loss_start"], rel=1e-4)


def test_demo_can_do_one_run(demo_corpus: Path, tmp_path: Path) -> None:
    assert main(["demo", "--steps", "15", "--only", "plain", "--data-dir", str(demo_corpus),
                 "--output-dir", str(tmp_path), "--accelerator", "cpu"]) == 0  # fmt: skip
    (only,) = json.loads((tmp_path / "demo.json").read_text())
    assert only["run"] == "plain"


def test_demo_unwritable_data_dir_is_a_clean_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = main(["demo", "--steps", "1", "--data-dir", str(blocker / "data")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("speedkit demo: error: Cannot write the example corpus")
    assert str(blocker / "data") in err
    assert "--data-dir" in err


def test_the_demo_kit_caches_only_where_loading_runs_in_process(small_corpus: Path) -> None:
    data = _KitVLMData(small_corpus, batch_size=8, corpus=SMALL_CORPUS, progress=False)
    data.setup("fit")
    assert isinstance(data.train_dataloader().dataset, SampleCache)
    data.speed_loader_kwargs = {"num_workers": 2, "persistent_workers": True}  # as tuned
    loader = data.train_dataloader()
    assert loader.num_workers == 2
    assert not isinstance(loader.dataset, SampleCache)
    assert data.sample_cache is None
