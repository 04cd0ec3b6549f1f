from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest

from lightning_speedkit import __version__
from lightning_speedkit._demo import (
    DemoConfig,
    DemoResult,
    _Kit,
    _KitVLMData,
    _quiet_third_party,
    time_per_sample,
)
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


def test_plan_counts_ddps_buckets_as_the_kits_strategies_set_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lightning_speedkit import plan_memory

    def ddp_total(*flags: str) -> str:
        assert main(["plan", "--params", "7e9", "--gpus", "8", "--gpu-mem", "80", *flags]) == 0
        out = capsys.readouterr().out
        return next(line for line in out.splitlines() if line.startswith("ddp ")).split()[6]

    gib = 2**30
    views = plan_memory(7e9, 8, gradient_as_bucket_view=True).per_device("ddp").total
    copies = plan_memory(7e9, 8).per_device("ddp").total
    assert views < copies  # the flag reaches plan_memory: one copy of the gradients fewer
    assert ddp_total() == f"{copies / gib:.2f}"
    assert ddp_total("--gradient-as-bucket-view") == f"{views / gib:.2f}"


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


def test_a_value_read_as_a_flag_is_told_how_to_write_it(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse reads ``-7e9`` as a flag and says only "expected one argument"."""
    assert main(["plan", "--params", "-7e9", "--gpus", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("speedkit plan: error: argument --params: expected one argument (a value "
                   "that starts with '-' goes after '=': `--params=-7e9`)")  # fmt: skip
    assert main(["plan", "--params=-7e9", "--gpus", "2"]) == 2  # now its own, clear refusal
    assert "must be a whole number of parameters of at least 1" in capsys.readouterr().err


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
    assert main([*args, "--device", "gpu"]) == 2
    assert "invalid choice: 'gpu'" in capsys.readouterr().err


def test_console_script_is_installed() -> None:
    exe = shutil.which("speedkit", path=str(Path(sys.executable).parent))
    assert exe is not None
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == f"speedkit {__version__}"


@pytest.mark.parametrize("flag", ["--steps", "--batch-size", "--devices", "--global-batch"])
def test_demo_refuses_non_positive_counts(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", flag, "0"]) == 2
    assert f"argument {flag}: must be a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_trains_plain_and_kit_and_prints_them_side_by_side(
    demo_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both runs accumulate two micro-batches per optimizer step (a global batch of 32):
    the plain run through Lightning, the kit's through AccumulationScheduler. On CPU the
    kit leaves RegionalCompile out and says why."""
    code = main(["demo", "--steps", "40", "--batch-size", "16", "--global-batch", "32",
                 "--data-dir", str(demo_corpus), "--output-dir", str(tmp_path),
                 "--accelerator", "cpu"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "plain: accumulate_grad_batches: 2 batches of 16 on 1 device(s) per optimizer" in out
    assert "kit: AccumulationScheduler: 2 batches of 16 on 1 device(s) per optimizer" in out
    assert "kit: RegionalCompile left out on CPU: the tiny VLM's compiled blocks ran" in out
    header = next(line for line in out.splitlines() if "plain" in line)
    assert header.split() == ["plain", "kit"]
    for row in ("samples/s", "MFU", "data wait (share of step)", "step time p99 (ms)",
                "peak memory (GiB)", "train loss, first steps", "train loss, last steps",
                "held-out token accuracy"):  # fmt: skip
        assert row in out
    assert "kit / plain samples/s:" in out
    if "NumWorkersTuner chose num_workers=0" in out:  # loading in-process: cached, warmed
        assert "kit: SampleCache: decoded samples kept in memory (same data, same order): " in out
        assert " in memory before the first step (" in out
        assert " decoded by the warm-up's workers" in out
    else:
        assert "kit: SampleCache left off: the tuned loader decodes in worker processes" in out
    plain, kit = json.loads((tmp_path / "demo.json").read_text())
    assert (plain["run"], kit["run"]) == ("plain", "kit")
    # the same optimisation: two micro-batches of the same data in the first step of both
    assert kit["loss_start"] == pytest.approx(plain["loss_start"], rel=1e-4)
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


@pytest.mark.multiprocess
@pytest.mark.slow
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


@pytest.mark.parametrize("on_cuda", [False, True])
def test_the_demo_kit_swaps_attention_everywhere_and_compiles_on_cuda(on_cuda: bool) -> None:
    """Every lever that keeps the numerics: AttentionSwap on CPU and CUDA (the decoder's
    bf16 parity failures were the measure's), RegionalCompile where it was measured to pay."""
    kit = _Kit.build(DemoConfig(steps=20), on_cuda)
    names = [type(c).__name__ for c in kit.callbacks()]
    expected = ["AttentionSwap", "FusedOptimizer", "NumWorkersTuner", "ProfilerSchedule"]
    if on_cuda:
        expected.insert(1, "RegionalCompile")
    assert names == expected
    notes = kit.notes(DemoConfig(steps=20))
    assert any(n.startswith("kit: AttentionSwap: 0 attention modules") for n in notes)
    assert any("RegionalCompile left out on CPU" in n for n in notes) is not on_cuda


def test_the_demo_note_tells_a_module_timed_faster_from_one_that_failed_parity() -> None:
    """auto keeps a module's own attention where it was timed faster: the demo said every
    module kept as it was had failed its parity check."""
    from types import SimpleNamespace

    kit = _Kit.build(DemoConfig(steps=20), False)
    reverted = [("a", "own forward faster: 'flash' ... 0.50x"), ("b", "parity error 3e-2")]
    kit.swap.report = SimpleNamespace(swapped=["c"], reverted=reverted)  # type: ignore[assignment]
    (note,) = [n for n in kit.notes(DemoConfig(steps=20)) if "AttentionSwap" in n]
    assert note.startswith(
        "kit: AttentionSwap: 1 attention modules on a fused kernel, "
        "1 kept their own (timed faster), 1 kept their own (parity);"
    )


def test_demo_can_do_one_run(demo_corpus: Path, tmp_path: Path) -> None:
    assert main(["demo", "--steps", "15", "--only", "plain", "--data-dir", str(demo_corpus),
                 "--output-dir", str(tmp_path), "--accelerator", "cpu"]) == 0  # fmt: skip
    (only,) = json.loads((tmp_path / "demo.json").read_text())
    assert only["run"] == "plain"


def test_the_demo_kit_caches_only_where_loading_runs_in_process(small_corpus: Path) -> None:
    data = _KitVLMData(small_corpus, batch_size=8, corpus=SMALL_CORPUS, progress=False)
    data.setup("fit")
    cache = data.train_dataloader().dataset  # the tuner's trials: cached, not warmed
    assert isinstance(cache, SampleCache)
    assert cache.warmed == 0
    data.speed_loader_kwargs = {"num_workers": 0}  # the tuner chose in-process loading
    assert data.train_dataloader().dataset is cache
    assert (cache.warmed, cache.misses) == (SMALL_CORPUS.train_samples, 0)  # warmed ahead
    data.speed_loader_kwargs = {"num_workers": 2, "persistent_workers": True}  # as tuned
    loader = data.train_dataloader()
    assert loader.num_workers == 2
    assert not isinstance(loader.dataset, SampleCache)
    assert data.sample_cache is None


# ------------------------------------------------------------------ bad input: one line


def _trace_files(root: Path) -> None:
    """Traces the report must refuse, each for one reason, and one it reads."""
    from tests.measure.test_report import synthetic_gpu_trace

    x = {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 1, "dur": 2, "tid": 1}
    traces: dict[str, Any] = {
        "good.json": synthetic_gpu_trace(),
        "list.json": [1, 2, 3],
        "strings.json": {"traceEvents": ["aten::mm"]},
        "ts.json": {"traceEvents": [{**x, "ts": "soon"}]},
        "dur.json": {"traceEvents": [x, {**x, "dur": None}]},
        "nan.json": {"traceEvents": [{**x, "ts": float("nan")}]},
        "args.json": {"traceEvents": [{**x, "args": [1]}]},
        "tid.json": {"traceEvents": [{**x, "tid": [1]}]},
        "memory.json": {
            "traceEvents": [{"ph": "i", "name": "[memory]", "args": {"Total Reserved": "lots"}}]
        },
        "devices.json": {"traceEvents": [x], "deviceProperties": 5},
    }
    for name, content in traces.items():
        (root / name).write_text(json.dumps(content))
    (root / "empty.json").write_text("")
    (root / "afile").write_text("a file, not a directory")
    (root / "locked").mkdir()
    (root / "locked" / "good.json").write_text(json.dumps(traces["good.json"]))


# Each row: a command line ({tmp}: a directory holding _trace_files), and what its one
# line on stderr must say: the flag (or file) and the bad value, and why where it helps.
BAD_INPUT = [
    # report: traces of the wrong shape, the trace a directory, --out where nothing can go
    ("report {tmp}/list.json", ["list.json", "event 0 is 1, not a JSON object"]),
    ("report {tmp}/strings.json", ["strings.json", "event 0 is 'aten::mm', not a JSON object"]),
    ("report {tmp}/ts.json", ["ts.json", "event 0's `ts` is 'soon', not a finite number"]),
    ("report {tmp}/dur.json", ["dur.json", "event 1's `dur` is None"]),
    ("report {tmp}/nan.json", ["nan.json", "`ts` is nan"]),
    ("report {tmp}/args.json", ["args.json", "`args` is [1], not a JSON object"]),
    ("report {tmp}/tid.json", ["tid.json", "`tid` is [1], not an id"]),
    ("report {tmp}/memory.json", ["memory.json", "`Total Reserved` is 'lots', not a number"]),
    ("report {tmp}/devices.json", ["devices.json", "`deviceProperties` is 5"]),
    ("report {tmp}/empty.json", ["empty.json", "is not a chrome trace"]),
    ("report {tmp}/missing.json", ["No trace at", "missing.json"]),
    ("report {tmp}", ["is a directory, not a trace"]),
    ("report {tmp}/good.json --out {tmp}/afile", ["--out", "afile", "is a file"]),
    ("report {tmp}/good.json --out {tmp}/afile/reports", ["--out", "afile/reports", "is a file"]),
    ("report {tmp}/good.json --out {tmp}/locked/reports", ["--out", "locked", "not writable"]),
    ("report {tmp}/locked/good.json", ["--out (default: the trace's directory)", "not writable"]),
    ("report {tmp}/good.json --step-ms inf", ["--step-ms", "got inf"]),
    ("report {tmp}/good.json --step-ms 0", ["--step-ms", "got 0"]),
    # plan: numbers finite and in range, --model that cannot build a model
    ("plan --params inf --gpus 2", ["--params", "got inf"]),
    ("plan --params nan --gpus 2", ["--params", "got nan"]),
    ("plan --params 0.5 --gpus 2", ["--params", "got 0.5"]),
    ("plan --params 7B --gpus 2", ["--params", "got '7B'"]),
    ("plan --params 7.5 --gpus 2", ["--params", "a whole number", "got 7.5"]),
    ("plan --params 1e9 --trainable nan --gpus 2", ["--trainable", "got nan"]),
    ("plan --params 1e9 --trainable -5 --gpus 2", ["--trainable", "got -5"]),
    ("plan --params 1e9 --trainable 2e9 --gpus 2", ["--trainable", "2,000,000,000", "--params"]),
    ("plan --params 7e10 --gpus 1 --gpu-mem 80 --headroom 1.5", ["--headroom", "got 1.5"]),
    ("plan --params 1e9 --gpus 2 --headroom 0", ["--headroom", "got 0"]),
    ("plan --params 1e9 --gpus 2 --gpu-mem inf", ["--gpu-mem", "got inf"]),
    ("plan --params 1e9 --gpus 0", ["--gpus", "got 0"]),
    ("plan --params 1e9", ["--gpus", "required"]),
    ("plan --params 1e9 --gpus 2 --seq 4096", ["`--batch`", "`--hidden`", "`--layers`"]),
    ("plan --params 1e9 --gpus 2 --heads 8", ["--heads", "--hidden"]),
    (
        "plan --params 1e9 --gpus 2 --batch 1 --seq 128 --hidden 2048 --layers 2 --heads 7",
        ["`--heads`", "must divide `--hidden 2048`", "got 7"],
    ),
    ("plan --model speedkit_examples.vlm --gpus 2", ["--model", "MODULE:FACTORY"]),
    (
        "plan --model not_a_module_xyz:build --gpus 2",
        ["--model", "cannot import 'not_a_module_xyz'"],
    ),
    ("plan --model speedkit_examples.vlm:nothing --gpus 2", ["--model", "'nothing'"]),
    (
        "plan --model speedkit_examples.vlm:VLMTask --gpus 2",
        ["--model", "needs arguments (config)"],
    ),
    ("plan --model speedkit_examples.vlm:VLM --gpus 2 --trainable 1e9", ["--trainable", "229,952"]),
    # bench-attention: devices, shapes, the output directory: all before any timing
    ("bench-attention --device tpu", ["--device", "'tpu'"]),
    ("bench-attention --device cuda", ["--device", "cuda", "--device cpu"]),
    ("bench-attention --out {tmp}/afile", ["--out", "afile", "is a file"]),
    ("bench-attention --out {tmp}/afile/results", ["--out", "afile/results"]),
    ("bench-attention --memory-limit -1", ["--memory-limit", "got -1"]),
    ("bench-attention --memory-limit nan", ["--memory-limit", "got nan"]),
    ("bench-attention --heads 8 --kv-heads 8 3", ["--kv-heads", "3 does not divide --heads 8"]),
    ("bench-attention --seq 0", ["--seq", "got 0"]),
    ("bench-attention --backends fastest", ["--backends", "'fastest'"]),
    ("bench-attention --dtype float64", ["--dtype", "'float64'"]),
    # bench-allreduce: processes, sizes, --json: all before any process starts
    ("bench-allreduce --nprocs 1", ["--nprocs", "got 1"]),
    ("bench-allreduce --backend nccl", ["--backend", "nccl", "--nprocs 2", "0 GPU(s)"]),
    ("bench-allreduce --backend mpi", ["--backend", "'mpi'"]),
    ("bench-allreduce --sizes 4KB infKB", ["--sizes", "'infKB'"]),
    ("bench-allreduce --sizes 2B", ["--sizes", "'2B'", "smaller than one float32"]),
    ("bench-allreduce --sizes lots", ["--sizes", "'lots'"]),
    ("bench-allreduce --iters 0", ["--iters", "got 0"]),
    ("bench-allreduce --warmup -1", ["--warmup", "got -1"]),
    ("bench-allreduce --json {tmp}/afile/rows.json", ["--json", "afile/rows.json", "is a file"]),
    ("bench-allreduce --json {tmp}", ["--json", "is a directory"]),
    # demo: accelerators, precisions, seeds, directories: all before any training
    ("demo --accelerator tpu", ["--accelerator", "'tpu'"]),
    ("demo --accelerator gpu", ["--accelerator", "gpu", "--accelerator cpu"]),
    ("demo --precision bogus", ["--precision", "'bogus'"]),
    ("demo --precision bf16", ["--precision", "'bf16'", "'bf16-mixed'"]),
    ("demo --size huge", ["--size", "'huge'"]),
    ("demo --seed -1", ["--seed", "got -1"]),
    ("demo --seed 4294967296", ["--seed", "got 4294967296"]),
    ("demo --num-workers -1", ["--num-workers", "got -1"]),
    ("demo --devices 0", ["--devices", "got 0"]),
    ("demo --only both", ["--only", "'both'"]),
    ("demo --output-dir {tmp}/afile", ["--output-dir", "afile", "is a file"]),
    ("demo --output-dir {tmp}/afile/runs", ["--output-dir", "afile/runs"]),
    ("demo --data-dir {tmp}/afile/corpus", ["--data-dir", "afile/corpus", "is a file"]),
    # the command itself
    ("", ["COMMAND", "required"]),
    ("train", ["invalid choice: 'train'"]),
    ("plan --params 1e9 --gpus 2 --bogus", ["unrecognized arguments: --bogus"]),
]

# The library's names for what the command line calls by its flags.
PYTHON_NAMES = ("world_size", "n_params", "trainable_params", "n_devices", "kv_heads", "seq_lens",
                "memory_limit_gib", "data_dir", "output_dir", "unprofiled_step_ms")  # fmt: skip


@pytest.fixture
def no_long_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only machine, and the training and benchmarks replaced by a failure: a row
    that reached them checked its input too late."""
    import torch

    from lightning_speedkit import _demo
    from lightning_speedkit.attention import bench
    from lightning_speedkit.distributed import allreduce_bench

    def too_late(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the input was checked after the long work began")

    monkeypatch.setattr(_demo, "run_demo", too_late)
    monkeypatch.setattr(bench, "bench_attention", too_late)
    monkeypatch.setattr(allreduce_bench, "bench_allreduce", too_late)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.parametrize(("command", "says"), BAD_INPUT, ids=[c or "nothing" for c, _ in BAD_INPUT])
@pytest.mark.usefixtures("no_long_work")
def test_bad_input_is_one_line_on_stderr_and_exit_status_2(
    command: str,
    says: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _trace_files(tmp_path)
    locked = str(tmp_path / "locked")
    access = os.access  # a directory nobody may write in (root may write anywhere)
    monkeypatch.setattr(
        os, "access", lambda p, mode, **kw: str(p) != locked and access(p, mode, **kw)
    )
    argv = [arg.format(tmp=tmp_path) for arg in command.split()]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("\n")
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    name = "speedkit" + (f" {argv[0]}" if argv and argv[0] in _subcommands() else "")
    assert err.startswith(f"{name}: error: "), err  # an unknown flag too names its command
    for text in says:
        assert text in err, (text, err)
    assert not [name for name in PYTHON_NAMES if name in err]


def test_the_kits_own_refusals_speak_of_flags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_speedkit import SpeedkitConfigError
    from lightning_speedkit.distributed import allreduce_bench
    from speedkit_examples.vlm import DataDirectoryError

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise SpeedkitConfigError(
            "`world_size` must be at least 2 for an all-reduce,\ngot 1; `iters=0` too."
        )

    monkeypatch.setattr(allreduce_bench, "bench_allreduce", refuse)
    assert main(["bench-allreduce"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "speedkit bench-allreduce: error: `--nprocs` must be at least 2 for an all-reduce, "
        "got 1; `--iters 0` too.\n"
    )

    def unwritable(*args: Any, **kwargs: Any) -> None:
        raise DataDirectoryError(
            "Cannot write the example corpus under `data_dir`='/data': Permission denied. "
            "Pass a writable directory: `speedkit demo --data-dir DIR`."
        )

    monkeypatch.setattr("lightning_speedkit._demo.run_demo", unwritable)
    assert main(["demo", "--accelerator", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("speedkit demo: error: Cannot write the example corpus under "
                          "`--data-dir`='/data': Permission denied.")  # fmt: skip
    assert len(err.splitlines()) == 1


def test_an_unexpected_error_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    plan_memory = importlib.import_module("lightning_speedkit.distributed.plan_memory")

    for bug in (ZeroDivisionError("a bug, not bad input"), OSError(5, "Input/output error")):

        def broken(*args: Any, bug: Exception = bug, **kwargs: Any) -> None:
            raise bug

        monkeypatch.setattr(plan_memory, "plan_memory", broken)
        with pytest.raises(type(bug)) as info:  # an OSError too: not an output path's
            main(["plan", "--params", "1e9", "--gpus", "2"])
        assert info.value is bug


def test_an_output_that_fails_to_write_after_the_checks_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_speedkit.measure.report import Report

    _trace_files(tmp_path)

    def disk_full(self: Report, directory: Path, stem: str = "") -> list[Path]:
        raise OSError(28, "No space left on device", str(Path(directory) / f"{stem}.md"))

    monkeypatch.setattr(Report, "write", disk_full)
    assert main(["report", str(tmp_path / "good.json"), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"speedkit report: error: argument --out: cannot write "
        f"'{tmp_path / 'r' / 'good.report.md'}': No space left on device\n"
    )


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize(
    "command",
    ["demo --output-dir /proc/speedkit-x", "report {tmp}/good.json --out /proc/speedkit-x"],
)
def test_an_output_directory_nothing_can_be_made_in_is_one_line_also_for_root(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Root passes every permission check, and under /proc nothing can be made: demo
    ended in CSVLogger's FileNotFoundError traceback after the check had passed."""
    _trace_files(tmp_path)
    argv = [arg.format(tmp=tmp_path) for arg in command.split()]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"speedkit {argv[0]}: error: argument {argv[-2]}: cannot write "
                          "'/proc/speedkit-x': "), err  # fmt: skip
    assert len(err.splitlines()) == 1, err


def test_lightning_profiler_traces_of_one_run_get_a_report_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lightning's PyTorchProfiler traces share their name up to its first dot: each
    report overwrote the one before."""
    _trace_files(tmp_path)
    good = (tmp_path / "good.json").read_text()
    stems = [f"fit-[Strategy]SingleDeviceStrategy.{hook}.1764429000123"
             for hook in ("training_step", "validation_step")]  # fmt: skip
    for stem in stems:
        (tmp_path / f"{stem}.pt.trace.json").write_text(good)
        assert main(["report", str(tmp_path / f"{stem}.pt.trace.json"), "--json"]) == 0
    capsys.readouterr()
    for stem in stems:
        for ending in ("md", "json", "png"):
            assert (tmp_path / f"{stem}.report.{ending}").is_file()
    assert not list(tmp_path.glob("fit-*Strategy.report.*"))  # the old, shared name


def test_a_gzip_trace_under_a_plain_json_name_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gzip

    _trace_files(tmp_path)
    download = tmp_path / "trace_download.json"
    download.write_bytes(gzip.compress((tmp_path / "good.json").read_bytes()))
    assert main(["report", str(download), "--json"]) == 0
    read = json.loads(capsys.readouterr().out)
    assert main(["report", str(tmp_path / "good.json"), "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)
    assert read.pop("source") == str(download)
    expected.pop("source")
    assert read == expected  # the same trace, the same report
    assert (tmp_path / "trace_download.report.md").is_file()


def test_plan_builds_the_example_model_its_help_names(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from speedkit_examples.vlm import VLM, CaptionTokenizer, VLMConfig

    assert main(["plan", "--model", "speedkit_examples.vlm:VLM", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    expected = sum(p.numel() for p in VLM(VLMConfig(CaptionTokenizer().vocab_size)).parameters())
    assert expected > 0
    assert out.splitlines()[0] == (
        f"speedkit_examples.vlm:VLM (VLMConfig's defaults): {expected:,} parameters, "
        f"{expected:,} trainable"
    )
    ddp = next(line for line in out.splitlines() if line.startswith("ddp "))
    assert float(ddp.split()[4]) == pytest.approx(16 * expected / 2**30, abs=0.01)
    assert torch.get_default_device() == torch.device("cpu")  # the meta device was left


def test_plan_imports_a_model_factory_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "my_models_xyz.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(10, 10)\n"
    )
    monkeypatch.chdir(tmp_path)
    path = list(sys.path)
    assert main(["plan", "--model", "my_models_xyz:build", "--gpus", "1"]) == 0
    assert capsys.readouterr().out.startswith("my_models_xyz:build: 110 parameters, 110 trainable")
    assert sys.path == path
    sys.modules.pop("my_models_xyz", None)


def test_a_model_factory_that_raises_is_one_line_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The factory is the user's code: its failure is input the command cannot use (exit
    status 2, one line naming the factory and the exception), not a bug of the kit."""
    (tmp_path / "my_broken_models_xyz.py").write_text(
        "def build():\n    raise RuntimeError('no config at cfg.yaml')\n"
    )
    (tmp_path / "my_failing_module_xyz.py").write_text(
        "raise KeyError('HOME_OF_DATA')\n\ndef build():\n    return None\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "my_broken_models_xyz:build", "--gpus", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "speedkit plan: error: argument --model: my_broken_models_xyz:build raised "
        "RuntimeError: no config at cfg.yaml (called with no arguments, on the meta device); "
        "fix the factory so that it builds the model, or give --params instead\n"
    )
    assert main(["plan", "--model", "my_failing_module_xyz:build", "--gpus", "2"]) == 2
    assert capsys.readouterr().err == (
        "speedkit plan: error: argument --model: importing 'my_failing_module_xyz' (from "
        "'my_failing_module_xyz:build') raised KeyError: 'HOME_OF_DATA'; fix the module so "
        "that it imports, or give --params instead\n"
    )
    for name in ("my_broken_models_xyz", "my_failing_module_xyz"):
        sys.modules.pop(name, None)


def test_bench_allreduce_writes_its_json_into_a_new_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_speedkit.distributed import allreduce_bench
    from lightning_speedkit.distributed.allreduce_bench import AllReduceResult

    row = AllReduceResult("gloo", 2, 4096, 50.0, 0.08192, 0.08192)
    monkeypatch.setattr(allreduce_bench, "bench_allreduce", lambda *args: [row])
    target = tmp_path / "results" / "today" / "allreduce.json"
    assert main(["bench-allreduce", "--sizes", "4KB", "--json", str(target)]) == 0
    assert "4KB" in capsys.readouterr().out
    assert json.loads(target.read_text()) == [
        {"backend": "gloo", "world_size": 2, "bytes": 4096, "time_us": 50.0,
         "algbw_gbps": 0.08192, "busbw_gbps": 0.08192}
    ]  # fmt: skip


def test_speak_of_flags_leaves_paths_and_unknown_names_alone() -> None:
    from lightning_speedkit.cli import speak_of_flags

    flags = {"data_dir": "--data-dir", "heads": "--heads"}
    assert speak_of_flags("`data_dir`='/srv/data_dir/x' or data_dir.", flags) == (
        "`--data-dir`='/srv/data_dir/x' or --data-dir."
    )
    assert speak_of_flags("`heads=3`, heads, `other`", flags) == "`--heads 3`, heads, `other`"


@pytest.mark.slow
def test_demo_freeze_vision_serves_the_towers_features_after_the_first_epoch(
    demo_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 4,096 samples in batches of 64: 64 steps an epoch, so 150 steps reach the third.
    code = main(["demo", "--steps", "150", "--batch-size", "64", "--freeze-vision",
                 "--data-dir", str(demo_corpus), "--output-dir", str(tmp_path),
                 "--accelerator", "cpu"])  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    share = re.search(r"plain: the frozen vision tower's forward took (\d+\.\d)% of the step", out)
    assert share is not None, out
    assert 0 < float(share.group(1)) < 100
    served = re.search(r"kit: FrozenFeatureCache: ([\d,]+) samples' tower features served", out)
    assert served is not None, out
    # epoch 2's first batch is the check; from its second batch on every sample is served
    assert int(served.group(1).replace(",", "")) >= (150 - 2 * 64) * 64
    plain, kit = json.loads((tmp_path / "demo.json").read_text())
    assert kit["loss_start"] == pytest.approx(plain["loss_start"], rel=1e-4)
