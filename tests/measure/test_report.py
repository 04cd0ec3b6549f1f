"""The bottleneck report: planted bottlenecks are found, a clean run is not blamed.

Each planted test trains a small job under ProfilerSchedule and asserts the finding
its bottleneck must produce; the synthetic GPU trace checks the device-side
accounting to the microsecond, since CI has no GPU. Eager attention's share is checked
on a synthetic step of exact durations (a real one's moves with the machine's load),
and on the real layer what does not depend on timing.
"""

from __future__ import annotations

import gzip
import inspect
import json
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_speedkit import AttentionSwap, ProfilerSchedule, SpeedkitConfigError
from lightning_speedkit.cli import main
from lightning_speedkit.measure import profiler_schedule
from lightning_speedkit.measure.report import (
    CATEGORIES,
    Report,
    _short_kernel_name,
    _top_level_names,
    analyze_trace,
    load_trace,
)
from tests.helpers.clock import VirtualClock
from tests.helpers.models import MLP, loader


def profile(
    module: L.LightningModule,
    data: DataLoader[Any],
    tmp_path: Path,
    callbacks: list[L.Callback] | None = None,
    active: int = 3,
) -> ProfilerSchedule:
    profiler = ProfilerSchedule(skip_first=8, wait=0, warmup=1, active=active, repeat=1,
                                dirpath=tmp_path)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", max_steps=8 + 1 + active, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[*(callbacks or []), profiler])  # fmt: skip
    trainer.fit(module, data)
    assert profiler.report is not None
    return profiler


@pytest.fixture
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    """ProfilerSchedule's clock reads the virtual one; the models and datasets sleep on it.
    The un-profiled steps it times, whose data wait the report takes, are then exact."""
    from types import SimpleNamespace

    from tests.helpers import models

    clock = VirtualClock()
    monkeypatch.setattr(profiler_schedule, "time", SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(models, "_sleep", clock.sleep)
    return clock


def cpu_step(data: float, matmul: float) -> dict[str, Any]:
    """One 1000 us CPU step: ``data`` us of fetching (``speedkit/data_fetch``), then an
    addmm of ``matmul`` us; the rest of the step is the framework's (overhead)."""
    return {"traceEvents": [
        _x("ProfilerStep#1", "user_annotation", 0, 1000),
        _x("speedkit/data_fetch", "user_annotation", 0, data),
        _x("aten::addmm", "cpu_op", data, matmul),
    ]}  # fmt: skip


def test_a_data_bound_step_is_found_first() -> None:
    report = analyze_trace(cpu_step(data=600, matmul=300))
    assert report.breakdown["data"] == pytest.approx(0.6, abs=1e-3)
    assert report.breakdown["matmul"] == pytest.approx(0.3, abs=1e-3)
    assert report.kinds == ["data"]  # and not compute: data explains the step
    (data,) = report.findings
    assert data.share == pytest.approx(0.6, abs=1e-3)
    assert data.evidence == (
        "data wait 60% of the step (0.6 of 1.0 ms): the model waits for the loader"
    )
    assert "NumWorkersTuner()" in data.fix


def test_a_slow_loader_is_found_with_its_unprofiled_data_wait(
    tmp_path: Path, virtual_clock: VirtualClock
) -> None:
    """A real run: 8 items of 1/64 s per batch (0.125 s) and a 0.25 s step, on the virtual
    clock. The report's data share is the un-profiled steps' wait: 1/3, exactly."""
    profiler = profile(MLP(step_delay=0.25), loader(n=256, delay=1 / 64), tmp_path)
    assert list(profiler._unprofiled[0]) == [0.125] * 7  # from the second step on
    report = profiler.report
    assert report is not None
    assert report.breakdown["data"] == pytest.approx(1 / 3)
    assert math.isclose(sum(report.breakdown.values()), 1.0, rel_tol=1e-6)
    (data,) = [f for f in report.findings if f.kind == "data"]
    assert data.share == pytest.approx(1 / 3)
    assert data.evidence.startswith("data wait 33% of the step")
    assert "NumWorkersTuner()" in data.fix


def test_a_fix_already_in_place_is_not_offered_again() -> None:
    from lightning_speedkit.measure.report import amend_for_callbacks

    report = analyze_trace(cpu_step(data=600, matmul=300))
    assert report.findings[0].fix.startswith("add NumWorkersTuner()")
    amend_for_callbacks(report, ["SpeedMonitor", "NumWorkersTuner"])
    assert report.findings[0].fix.startswith("NumWorkersTuner is already on")


class Big(MLP):
    def __init__(self) -> None:
        super().__init__(dim=512, hidden=2048, step_delay=0.25)


def in_memory(dim: int, n: int = 512, batch_size: int = 64) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.randn(n, dim)), batch_size=batch_size)


class BigOnTensors(Big):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch[0], batch_idx)


def test_a_compute_bound_step_is_not_blamed_on_data() -> None:
    report = analyze_trace(cpu_step(data=50, matmul=850))
    assert report.breakdown["data"] == pytest.approx(0.05, abs=1e-3)  # under DATA_SHARE
    assert report.breakdown["matmul"] == pytest.approx(0.85, abs=1e-3)
    assert report.kinds == ["compute"]
    assert report.findings[0].evidence.startswith("compute-bound: operators 85% of the step")


def test_a_step_mostly_outside_any_operator_is_overhead_bound_not_compute_bound() -> None:
    """A 1000 us CPU step with 100 us of addmm and 80 us of add: the other 820 us are
    Python and the framework between operators. The report called it compute-bound."""
    report = analyze_trace({"traceEvents": [
        _x("ProfilerStep#1", "user_annotation", 0, 1000),
        _x("aten::addmm", "cpu_op", 0, 100),
        _x("aten::add", "cpu_op", 100, 80),
    ]})  # fmt: skip
    assert report.breakdown["overhead"] == pytest.approx(0.82, abs=1e-3)
    assert report.kinds == ["compute"]
    (finding,) = report.findings
    assert finding.share == pytest.approx(1.0, abs=1e-3)
    assert finding.evidence == (
        "overhead-bound: 82% of the step is spent outside any operator (Python, the framework "
        "between operators) against 18% in operators (matmul 10%): the host's own work, not "
        "computation, sets the pace"
    )


def test_a_clean_compute_bound_run_is_not_blamed_on_data(
    tmp_path: Path, virtual_clock: VirtualClock
) -> None:
    """A real run whose batches are in memory: on the virtual clock its fetches take no time
    at all, so the data share is 0 exactly, and what is found is compute."""
    report = profile(BigOnTensors(), in_memory(512), tmp_path).report
    assert report is not None
    assert report.breakdown["data"] == 0.0
    assert "data" not in report.kinds
    assert "compute" in report.kinds
    assert math.isclose(sum(report.breakdown.values()), 1.0, rel_tol=1e-6)


class ItemInStep(MLP):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.last = loss.item()  # planted: a host-device sync in every step
        return loss


def test_an_item_in_training_step_is_named_with_its_line(tmp_path: Path) -> None:
    report = profile(ItemInStep(), loader(n=256), tmp_path).report
    assert report is not None
    (finding,) = [f for f in report.findings if f.kind == "host_sync"]
    lines, first = inspect.getsourcelines(ItemInStep.training_step)
    planted = first + next(i for i, line in enumerate(lines) if ".item()" in line)
    site = f"tests/measure/test_report.py:{planted} in training_step"
    assert site in finding.evidence
    assert "self.last = loss.item()" in finding.evidence
    assert "blocks the host" in finding.evidence
    ((row),) = [s for s in report.sync_sites if s["user_code"]]
    assert row["per_step"] == 1.0


def test_without_item_no_sync_is_blamed_on_the_user(tmp_path: Path) -> None:
    report = profile(MLP(), loader(n=256), tmp_path).report
    assert report is not None
    assert "host_sync" not in report.kinds


class EagerAttention(L.LightningModule):
    """One eager softmax attention layer over long sequences (512 tokens)."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        weights = (q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)).softmax(dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(B, N, C))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def sequences() -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.randn(48, 512, 64)), batch_size=4)


def attention_step(fused: bool) -> dict[str, Any]:
    """One 1000 us CPU step of an attention layer over long sequences, with the operators
    torch.profiler records for it. Eager: data 0-50, the qkv projection 50-150, q @ k^T
    150-350 (aten::matmul, its aten::bmm from 155), a scale 350-380, the softmax 380-500,
    weights @ v 500-700 (its bmm from 505), the output projection 700-750, then backward:
    a bmm 760-900 and the softmax's 900-950. Attention: 195 + 120 + 195 + 140 + 50 us.
    Fused: one scaled_dot_product_attention 150-450 instead, its backward 760-900."""
    step = [_x("ProfilerStep#1", "user_annotation", 0, 1000),
            _x("speedkit/data_fetch", "user_annotation", 0, 50),
            _x("aten::linear", "cpu_op", 50, 100)]  # fmt: skip
    if fused:
        step += [
            _x("aten::scaled_dot_product_attention", "cpu_op", 150, 300),
            _x("aten::_scaled_dot_product_flash_attention_for_cpu", "cpu_op", 155, 295),
            _x("aten::linear", "cpu_op", 700, 50),
            _x("autograd::engine::evaluate_function: SdpaBackward0", "cpu_op", 755, 200),
            _x("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "cpu_op", 760, 140),
        ]
    else:
        step += [
            _x("aten::matmul", "cpu_op", 150, 200),
            _x("aten::bmm", "cpu_op", 155, 195),
            _x("aten::div", "cpu_op", 350, 30),
            _x("aten::softmax", "cpu_op", 380, 120),
            _x("aten::_softmax", "cpu_op", 385, 115),
            _x("aten::matmul", "cpu_op", 500, 200),
            _x("aten::bmm", "cpu_op", 505, 195),
            _x("aten::linear", "cpu_op", 700, 50),
            _x("autograd::engine::evaluate_function: BmmBackward0", "cpu_op", 755, 145),
            _x("aten::bmm", "cpu_op", 760, 140),
            _x("SoftmaxBackward0", "cpu_op", 900, 50),
            _x("aten::_softmax_backward_data", "cpu_op", 900, 50),
        ]
    return {"traceEvents": step}


def op_names(profiler: ProfilerSchedule) -> set[str]:
    return {e.get("name", "") for t in profiler.traces for e in load_trace(t)["traceEvents"]}


def test_eager_attention_at_long_sequences_is_found_and_the_swap_clears_it(
    tmp_path: Path,
) -> None:
    # The finding and its numbers on a step of exact durations: a real run's shares move
    # with the machine's load (eager attention is ~0.5 of the step on an idle machine).
    report = analyze_trace(attention_step(fused=False))
    assert report.kinds == ["attention"]
    assert report.breakdown["attention"] == pytest.approx(0.7, abs=2e-3)
    (finding,) = [f for f in report.findings if f.kind == "attention"]
    assert "AttentionSwap()" in finding.fix
    assert "attention" not in analyze_trace(attention_step(fused=True)).kinds
    # The real layer's trace is the one that step stands for: softmax and batched matmuls,
    # no fused operator. And the fix it names works: with the swap, attention is fused and
    # no longer a finding (whatever the timing: a fused operator means none is unfused).
    eager = profile(EagerAttention(), sequences(), tmp_path / "eager")
    names = op_names(eager)
    assert {"aten::softmax", "aten::bmm", "aten::_softmax_backward_data"} <= names
    assert not any("scaled_dot_product" in name for name in names)
    # "flash" named: "auto" times its candidates, and on a loaded machine "math" can win.
    swapped = profile(EagerAttention(), sequences(), tmp_path / "swapped",
                      callbacks=[AttentionSwap("flash", verbose=False)])  # fmt: skip
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in op_names(swapped)
    assert swapped.report is not None
    assert "attention" not in swapped.report.kinds


def comm_step(all_reduce: float) -> dict[str, Any]:
    """One 1000 us CPU step of a DDP rank: the main thread computes 0-400 and then waits,
    while gloo's thread all-reduces from 450 for ``all_reduce`` us."""
    return {"traceEvents": [
        _x("ProfilerStep#1", "user_annotation", 0, 1000),
        _x("aten::addmm", "cpu_op", 0, 400),
        _x("gloo:all_reduce", "cpu_op", 450, all_reduce, tid=2),
    ]}  # fmt: skip


def test_exposed_communication_is_found_from_its_share() -> None:
    report = analyze_trace(comm_step(all_reduce=400))
    assert report.breakdown["communication"] == pytest.approx(0.4, abs=1e-3)
    assert report.breakdown["matmul"] == pytest.approx(0.4, abs=1e-3)
    assert report.kinds == ["communication"]
    assert report.findings[0].evidence == (
        "exposed gradient communication 40% of the step (not overlapped with compute)"
    )
    assert report.findings[0].fix.startswith("strategy='ddp_powersgd'")
    # 20% of the step: under COMMUNICATION_SHARE, the step is compute's
    below = analyze_trace(comm_step(all_reduce=200))
    assert below.breakdown["communication"] == pytest.approx(0.2, abs=1e-3)
    assert below.kinds == ["compute"]


@pytest.mark.multiprocess
def test_a_ddp_jobs_all_reduce_is_communication_on_every_rank(tmp_path: Path) -> None:
    """Two gloo ranks all-reducing 16 MiB of gradients per step. Their communication share
    moves with the machine's load (0.25 to 0.58 measured): the threshold is judged on the
    synthetic step above; here, that every rank's report counts its all-reduce."""
    from tests.helpers.multiprocess import run_script

    ranks = run_script("profile_ddp.py", tmp_path)
    for rank, result in enumerate(ranks):
        assert result["breakdown"]["communication"] > 0.0, result
        assert math.isclose(sum(result["breakdown"].values()), 1.0, rel_tol=1e-6)
        trace = load_trace(tmp_path / "profiler" / f"rank{rank}-window0.pt.trace.json.gz")
        names = {e.get("name") for e in trace["traceEvents"] if e.get("ph") == "X"}
        assert "gloo:all_reduce" in names
    names = sorted(Path(f).name for r in ranks for f in r["files"])
    assert "speedkit_report.md" in names
    assert "speedkit_report-rank1.md" in names


def test_report_files_are_written_next_to_the_traces(tmp_path: Path) -> None:
    profiler = profile(MLP(), loader(n=256), tmp_path)
    names = sorted(p.name for p in profiler.report_files)
    assert names == ["speedkit_report.json", "speedkit_report.md", "speedkit_report.png"]
    saved = json.loads((tmp_path / "speedkit_report.json").read_text())
    assert saved["breakdown"] == pytest.approx(profiler.report.breakdown)  # type: ignore[union-attr]
    assert saved["steps"] == 3
    markdown = (tmp_path / "speedkit_report.md").read_text()
    assert "## Where the step goes" in markdown
    assert (tmp_path / "speedkit_report.png").read_bytes()[:4] == b"\x89PNG"


def test_a_failing_report_warns_once_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Report:
        raise ValueError("planted")

    monkeypatch.setattr(profiler_schedule, "analyze_trace", broken)
    callback = ProfilerSchedule(skip_first=0, wait=0, warmup=0, active=1, repeat=3,
                                dirpath=tmp_path)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", max_steps=5, logger=False, callbacks=[callback],
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    with pytest.warns(UserWarning, match="report of .* failed .*planted") as record:
        trainer.fit(MLP(), loader(n=256))
    assert sum("planted" in str(w.message) for w in record) == 1
    assert trainer.global_step == 5
    assert len(callback.traces) == 3  # the traces are still written
    assert callback.report is None


# ------------------------------------------------------------- other profilers' traces


def _lightning_profiled(tmp_path: Path, active: int, delay: float = 0.0) -> Path:
    """The trace of Lightning's PyTorchProfiler over 6 steps: wait 1, warm up 1, ``active``."""
    from lightning.pytorch.profilers import PyTorchProfiler

    schedule = torch.profiler.schedule(wait=1, warmup=1, active=active)
    profiler = PyTorchProfiler(dirpath=tmp_path, filename="lt", export_to_chrome=True,
                               schedule=schedule)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", max_steps=6, logger=False, profiler=profiler,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(MLP(), loader(n=256, delay=delay))
    (trace,) = sorted(tmp_path.glob("*.pt.trace.json"))
    return trace


def test_lightning_pytorch_profiler_trace_is_understood(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _lightning_profiled(tmp_path, active=2, delay=0.004)
    assert main(["report", str(trace), "--out", str(tmp_path / "out"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == 2
    # "[pl][module]...: net", "net.0", ...: the single child's children, one depth only
    assert set(report["modules"]) == {"net.0", "net.1", "net.2"}
    assert sum(report["modules"].values()) == pytest.approx(1.0)
    # Lightning's train_dataloader_next regions are the loader's: counted as data (how
    # much moves with the machine's load; the share is judged on the step below)
    names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
    assert any("train_dataloader_next" in name for name in names)
    assert report["breakdown"]["data"] > 0.0
    assert sorted(p.name for p in (tmp_path / "out").iterdir())[0].endswith(".report.json")


def test_lightnings_loader_region_is_data_wait() -> None:
    fetch = "[pl][profile][_TrainingEpochLoop].train_dataloader_next"
    events = [_x("ProfilerStep#1", "user_annotation", 0, 1000),
              _x(fetch, "user_annotation", 0, 600),
              _x("aten::addmm", "cpu_op", 600, 300)]  # fmt: skip
    report = analyze_trace({"traceEvents": events})
    assert report.breakdown["data"] == pytest.approx(0.6, abs=1e-3)
    assert report.kinds == ["data"]


def test_lightning_profiler_trace_cut_short_by_the_fits_end_counts_only_whole_steps(
    tmp_path: Path,
) -> None:
    # The window outlasts training: torch's last range holds the last backward and the
    # fit's teardown, no training_step. Steps 2-5 ran in the window.
    trace = _lightning_profiled(tmp_path, active=10)
    names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {f"ProfilerStep#{i}" for i in range(2, 7)} <= names  # torch's 5 ranges
    assert analyze_trace(trace).steps == 4


def test_lightning_module_names_are_read_at_the_top_level_depth() -> None:
    names = {"model", "model.vision", "model.vision.blocks", "model.vision.blocks.0",
             "model.projector", "model.decoder", "model.decoder.head"}  # fmt: skip
    assert _top_level_names(names) == {"model.vision", "model.projector", "model.decoder"}
    assert _top_level_names({"encoder", "encoder.0", "head"}) == {"encoder", "head"}
    assert _top_level_names({"net"}) == {"net"}


def test_blocks_of_a_module_list_are_one_row_in_lightnings_traces() -> None:
    """Lightning's PyTorchProfiler marks every module that is called: a ModuleList (no
    forward) never is, so its blocks appear without their parent. They are its row."""
    names = {"inp", "blocks.0", "blocks.0.mlp", "blocks.1", "blocks.1.mlp", "out"}
    assert _top_level_names(names) == {"inp", "blocks", "out"}
    # nanoGPT's own: a ModuleDict `transformer` (embeddings, a ModuleList `h`, a norm)
    gpt = {"model", "model.transformer.wte", "model.transformer.wpe", "model.transformer.h.0",
           "model.transformer.h.0.attn", "model.transformer.h.1", "model.transformer.ln_f",
           "model.lm_head"}  # fmt: skip
    assert _top_level_names(gpt) == {"model.transformer", "model.lm_head"}
    # a single list of blocks is looked into, as a single model is
    assert _top_level_names({"layers.0", "layers.1"}) == {"layers.0", "layers.1"}


def _pl_module(name: str, ts: float, dur: float) -> dict[str, Any]:
    return _x(f"[pl][module]torch.nn.modules.linear.Linear: {name}", "user_annotation", ts, dur)


def test_a_nanogpt_style_models_blocks_take_their_share() -> None:
    """One 1000 us step of an input layer (9 us), three blocks of 125 us each, their
    inner layers marked too, and an output layer (9 us): exact shares, adding up to 1."""
    events = [_x("ProfilerStep#1", "user_annotation", 0, 1000), _pl_module("inp", 10, 9)]
    for i in range(3):
        start = 20 + 125 * i
        events += [_pl_module(f"blocks.{i}", start, 125),
                   _pl_module(f"blocks.{i}.mlp", start + 5, 100)]  # fmt: skip
    events += [_pl_module("out", 400, 9), _x("aten::mm", "cpu_op", 10, 400)]
    modules = analyze_trace({"traceEvents": events}).modules
    total = 9 + 3 * 125 + 9
    assert modules == {"blocks": pytest.approx(375 / total), "inp": pytest.approx(9 / total),
                       "out": pytest.approx(9 / total)}  # fmt: skip
    assert list(modules) == ["blocks", "inp", "out"]  # the heaviest first
    assert sum(modules.values()) == pytest.approx(1.0)
    # ProfilerSchedule marks each block under the list's name: the same row
    marked = [_x("ProfilerStep#1", "user_annotation", 0, 1000),
              _x("speedkit/module/inp", "user_annotation", 10, 9),
              *(_x("speedkit/module/blocks", "user_annotation", 20 + 125 * i, 125)
                for i in range(3)),
              _x("speedkit/module/out", "user_annotation", 400, 9),
              _x("aten::mm", "cpu_op", 10, 400)]  # fmt: skip
    assert analyze_trace({"traceEvents": marked}).modules == modules


def test_on_a_gpu_a_lists_blocks_are_one_row_by_the_kernels_they_launched() -> None:
    """Lightning's marks on a GPU trace: each kernel goes to the module whose forward
    launched it; the blocks' kernels (200 + 300 us) to `blocks`, the head's (100 us) to it."""
    host = [_x("ProfilerStep#1", "user_annotation", 0, 1000),
            _pl_module("blocks.0", 0, 100), _pl_module("blocks.0.mlp", 10, 50),
            _x("cudaLaunchKernel", "cuda_runtime", 20, 5, correlation=1),
            _pl_module("blocks.1", 100, 100),
            _x("cudaLaunchKernel", "cuda_runtime", 120, 5, correlation=2),
            _pl_module("head", 200, 50),
            _x("cudaLaunchKernel", "cuda_runtime", 210, 5, correlation=3)]  # fmt: skip
    device = [_x("sm90_xmma_gemm_bf16", "kernel", 100, 200, tid=7, correlation=1),
              _x("sm90_xmma_gemm_bf16", "kernel", 300, 300, tid=7, correlation=2),
              _x("sm90_xmma_gemm_bf16", "kernel", 600, 100, tid=7, correlation=3)]  # fmt: skip
    report = analyze_trace({"traceEvents": host + device})
    assert report.modules == {"blocks": pytest.approx(5 / 6), "head": pytest.approx(1 / 6)}


def test_plain_torch_profiler_trace_gz_or_not(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    x = torch.randn(64, 256)
    path = tmp_path / "plain.json"
    with torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=0, warmup=1, active=2),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    ) as prof:
        for _ in range(3):
            model(x).sum().backward()
            prof.step()
    report = analyze_trace(path)
    assert report.steps == 2
    assert report.kinds == ["compute"]  # no loader, collective, sync or attention in it
    categories = {op["name"]: op["category"] for op in report.top_ops}
    assert categories["aten::addmm"] == "matmul"  # the Linear layers' forward
    assert math.isclose(sum(report.breakdown.values()), 1.0, rel_tol=1e-6)
    zipped = tmp_path / "plain.json.gz"
    zipped.write_bytes(gzip.compress(path.read_bytes()))
    assert analyze_trace(zipped).breakdown == pytest.approx(report.breakdown)
    # gzip is told by its first bytes, not the name: renamed either way, still read
    renamed = tmp_path / "trace_download.json"
    renamed.write_bytes(zipped.read_bytes())
    assert analyze_trace(renamed).breakdown == pytest.approx(report.breakdown)
    unzipped = tmp_path / "unzipped.json.gz"
    unzipped.write_bytes(path.read_bytes())
    assert analyze_trace(unzipped).breakdown == pytest.approx(report.breakdown)


def test_bad_traces_are_refused_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SpeedkitConfigError, match="No trace at"):
        analyze_trace(tmp_path / "missing.json")
    (tmp_path / "notes.json").write_text('{"hello": 1}')
    with pytest.raises(SpeedkitConfigError, match="no `traceEvents`"):
        analyze_trace(tmp_path / "notes.json")
    (tmp_path / "broken.json.gz").write_bytes(b"not gzip")
    with pytest.raises(SpeedkitConfigError, match="not a chrome trace"):
        analyze_trace(tmp_path / "broken.json.gz")
    (tmp_path / "cut.json").write_bytes(gzip.compress(b'{"traceEvents": []}' * 50)[:30])
    with pytest.raises(SpeedkitConfigError, match="not a chrome trace"):  # gzip, cut short
        analyze_trace(tmp_path / "cut.json")
    (tmp_path / "garbled.json").write_bytes(b"\x1f\x8b\x08\x00" + b"\xff" * 40)
    with pytest.raises(SpeedkitConfigError, match="not a chrome trace"):  # bad deflate data
        analyze_trace(tmp_path / "garbled.json")
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "speedkit report: error: No trace at" in capsys.readouterr().err


def test_a_frame_name_that_is_not_utf8_costs_only_its_own_characters(tmp_path: Path) -> None:
    # torch's profiler with stacks on has written such names (pytorch/pytorch#130622: a
    # frame named b"getpass.py(0): \x10\xd6\x07\xc4\xff/"); reading one refused the trace.
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    path = tmp_path / "stacks.json"
    with torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=0, warmup=1, active=2),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
        with_stack=True,
    ) as prof:
        for _ in range(3):
            model(torch.randn(8, 64)).sum().backward()
            prof.step()
    clean = analyze_trace(path)
    raw = path.read_bytes()
    start = raw.index(b'"name": "', raw.index(b'"cat": "python_function"')) + len(b'"name": "')
    end = raw.index(b'"', start)
    path.write_bytes(raw[:start] + b"getpass.py(0): \x10\xd6\x07\xc4\xff/" + raw[end:])
    names = [e.get("name") for e in load_trace(path)["traceEvents"]]
    assert "getpass.py(0): \x10\ufffd\x07\ufffd\ufffd/" in names
    assert len(names) == len(json.loads(raw)["traceEvents"])  # every other event kept
    zipped = tmp_path / "stacks.json.gz"
    zipped.write_bytes(gzip.compress(path.read_bytes()))
    for garbled in (path, zipped):
        report = analyze_trace(garbled)
        assert report.steps == clean.steps == 2
        assert report.breakdown == pytest.approx(clean.breakdown)


# ---------------------------------------------------------------- the device timeline


def _x(name: str, cat: str, ts: float, dur: float, tid: Any = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid,
            "args": args}  # fmt: skip


def synthetic_gpu_trace() -> dict[str, Any]:
    """One 1000 us step: data 0-200 (device idle), a GEMM 200-500 launched inside the
    vision module, flash attention 500-600 in the language model, an all-reduce 550-800
    (its first 50 us hidden under attention), a stream sync 800-810 after which the
    device idles until 850, an elementwise kernel 850-900, then idle to the end."""
    host = [
        _x("ProfilerStep#1", "user_annotation", 0, 1000),
        _x("speedkit/data_fetch", "user_annotation", 0, 200),
        _x("speedkit/module/vision", "user_annotation", 200, 200),
        _x("cudaLaunchKernel", "cuda_runtime", 210, 5, correlation=1),
        _x("speedkit/module/language_model", "user_annotation", 400, 100),
        _x("aten::_scaled_dot_product_flash_attention", "cpu_op", 440, 20, **{"External id": 7}),
        _x("cudaLaunchKernel", "cuda_runtime", 450, 5, correlation=2),
        _x("cudaStreamSynchronize", "cuda_runtime", 800, 10, correlation=3),
    ]
    device = [
        _x("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", 200, 300, tid=7, correlation=1),
        _x("flash_fwd_kernel", "kernel", 500, 100, tid=7, correlation=2, **{"External id": 7}),
        _x("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "kernel", 550, 250, tid=9),
        _x("vectorized_elementwise_kernel", "kernel", 850, 50, tid=7),
    ]
    return {"traceEvents": host + device}


def test_device_time_is_split_by_kernel_and_idle_by_what_the_host_did() -> None:
    report = analyze_trace(synthetic_gpu_trace())
    assert report.device == "cuda"
    assert report.step_ms == pytest.approx(1.0)
    expected = {
        "data": 0.2,
        "matmul": 0.3,
        "attention": 0.1,
        "communication": 0.2,
        "host_sync": 0.05,
        "elementwise": 0.05,
        "memory_copy": 0,
        "overhead": 0.1,
    }
    assert list(report.breakdown) == list(CATEGORIES)
    for name, share in expected.items():
        assert report.breakdown[name] == pytest.approx(share, abs=2e-3), name
    # kernels are attributed to the module whose forward launched them
    assert report.modules == {"vision": pytest.approx(0.75), "language_model": pytest.approx(0.25)}
    assert report.kinds[0] == "data"
    # 75% of forward time but 30% of the step: under the 40% that makes it a finding
    assert "vision_encoder" not in report.kinds
    assert "attention" not in report.kinds  # fused (flash) already


def test_cast_and_copy_kernels_count_as_copies_and_name_the_compute_finding() -> None:
    """One 1000 us step, all device time: a GEMM 0-300, a cast launched by aten::copy_
    300-550, a transpose copy known by its kernel name 550-700, an add 700-1000."""
    host = [
        _x("ProfilerStep#1", "user_annotation", 0, 1000),
        _x("aten::copy_", "cpu_op", 290, 5, **{"External id": 3}),
        _x("cudaLaunchKernel", "cuda_runtime", 291, 2, correlation=3),
    ]
    cast = "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_cast>(int)"
    device = [
        _x("nvjet_sm90_tst_256x128_64x4_2x4_h_bz_coopA_NNT", "kernel", 0, 300, tid=7),
        _x(cast, "kernel", 300, 250, tid=7, correlation=3, **{"External id": 3}),
        _x("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
           "at::TensorIteratorBase&)::{lambda()#3}>(int)", "kernel", 550, 150, tid=7),
        _x("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<"
           "float>, std::array<char*, 3ul> >(int)", "kernel", 700, 300, tid=7),
    ]  # fmt: skip
    report = analyze_trace({"traceEvents": host + device})
    assert report.breakdown["memory_copy"] == pytest.approx(0.4, abs=2e-3)
    assert report.breakdown["elementwise"] == pytest.approx(0.3, abs=2e-3)
    assert report.breakdown["matmul"] == pytest.approx(0.3, abs=2e-3)
    ops = {op["name"]: op["category"] for op in report.top_ops}
    assert ops == {
        "vectorized_elementwise_kernel<bfloat16_cast>": "memory_copy",
        "unrolled_elementwise_kernel<direct_copy_kernel_cuda>": "memory_copy",
        "vectorized_elementwise_kernel<CUDAFunctor_add<float>>": "elementwise",
        "nvjet_sm90_tst_256x128_64x4_2x4_h_bz_coopA_NNT": "matmul",
    }
    (finding,) = report.findings
    assert finding.kind == "compute"
    assert "copies and dtype casts take 40%" in finding.evidence
    assert "torch.compile" in finding.fix


def test_a_cuda_run_profiled_without_device_activity_gets_the_gpu_advice() -> None:
    """A GPU run traced without its kernels: host operators and their CUDA launches. Its
    matmul-bound step must not get the CPU's fixes. A GPU merely listed (torch lists the
    machine's GPUs in a CPU run's trace too) leaves the CPU's fixes, with a note."""
    host = [
        _x("ProfilerStep#1", "user_annotation", 0, 1000),
        _x("aten::mm", "cpu_op", 0, 800),
        _x("aten::add_", "cpu_op", 800, 100),
    ]
    launch = [_x("cudaLaunchKernel", "cuda_runtime", 790, 5, correlation=1)]
    listed = {"deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3",
                                    "totalGlobalMem": 85e9}]}  # fmt: skip
    on_cpu = analyze_trace({"traceEvents": host})
    on_gpu = analyze_trace({"traceEvents": host + launch})
    gpu_beside = analyze_trace({"traceEvents": host, **listed})
    assert (on_cpu.device, on_gpu.device, gpu_beside.device) == ("cpu", "cuda", "cpu")
    assert on_gpu.breakdown == pytest.approx(on_cpu.breakdown, abs=1e-9)  # the host's shares
    for report in (on_cpu, on_gpu, gpu_beside):
        assert [f.kind for f in report.findings] == ["compute"]
    assert "native bf16" in on_cpu.findings[0].fix
    assert "native bf16" in gpu_beside.findings[0].fix
    assert "native bf16" not in on_gpu.findings[0].fix
    assert on_gpu.findings[0].fix.startswith("bf16-mixed precision if not already")
    assert any("without the device's activity" in note for note in on_gpu.notes)
    assert any("lists a GPU but recorded no device activity" in n for n in gpu_beside.notes)
    assert not any("device activity" in note for note in on_cpu.notes)


def _marked_steps(n: int, *, trailing: bool, marks: bool = True) -> list[dict[str, Any]]:
    """``n`` host steps of 1000 us (a forward mark and an add in each, when ``marks``),
    then, if ``trailing``, torch's 100 us range for a step that never ran."""
    out = []
    for i in range(n):
        t = i * 1000
        out.append(_x(f"ProfilerStep#{i}", "user_annotation", t, 1000))
        if marks:
            out.append(_x("speedkit/forward", "user_annotation", t + 10, 500))
        out.append(_x("aten::add", "cpu_op", t + 20, 900))
    if trailing:
        out.append(_x(f"ProfilerStep#{n}", "user_annotation", n * 1000, 100))
    return out


def test_a_step_range_without_a_forward_is_not_a_step() -> None:
    """A window cut short keeps torch's range for the step that never ran."""
    report = analyze_trace({"traceEvents": _marked_steps(2, trailing=True)})
    assert report.steps == 2
    assert report.step_ms == pytest.approx(1.0)


def test_without_forward_marks_every_step_range_counts() -> None:
    """Traces of other profilers (Lightning's, torch's own) carry no marks: all steps."""
    report = analyze_trace({"traceEvents": _marked_steps(2, trailing=True, marks=False)})
    assert report.steps == 3


@pytest.mark.parametrize("mark", ["speedkit/validation", "speedkit/aborted"])
def test_a_step_that_validated_or_failed_is_not_a_training_step(mark: str) -> None:
    """ProfilerSchedule marks validation run inside a window and the step an exception
    ended: left out while another step remains; kept where every step has the mark."""
    events = _marked_steps(3, trailing=False)
    events.append(_x(mark, "user_annotation", 1600, 300))  # inside the second step
    report = analyze_trace({"traceEvents": events})
    assert report.steps == 2
    every = [*_marked_steps(1, trailing=False), _x(mark, "user_annotation", 600, 300)]
    assert analyze_trace({"traceEvents": every}).steps == 1


def test_device_mirrors_of_the_marks_neither_count_as_steps_nor_keep_one() -> None:
    """CUDA traces repeat each range on the device's timeline: a lagging device's forward
    mark inside the trailing host range must not make it a step, nor its steps count."""
    host = _marked_steps(2, trailing=True)
    mirrored = [
        _x("ProfilerStep#0", "gpu_user_annotation", 300, 1000, tid=7),
        _x("ProfilerStep#1", "gpu_user_annotation", 1300, 950, tid=7),
        _x("speedkit/forward", "gpu_user_annotation", 2010, 50, tid=7),  # in the trailing range
    ]
    report = analyze_trace({"traceEvents": host + mirrored})
    assert report.steps == 2
    assert report.step_ms == pytest.approx(1.0)


def test_device_idle_is_what_the_unprofiled_step_leaves() -> None:
    """The synthetic step is 1000 us under the profiler, 950 us without: the kernels keep
    their 750 us, the unexplained idle shrinks from 100 to 50 us."""
    report = analyze_trace(synthetic_gpu_trace(), unprofiled_step_ms=0.95)
    assert report.step_ms == pytest.approx(0.95)
    assert report.breakdown["overhead"] == pytest.approx(0.05 / 0.95, abs=3e-3)
    assert report.breakdown["matmul"] == pytest.approx(0.3 / 0.95, abs=3e-3)
    assert any("un-profiled" in note for note in report.notes)
    # never below what the kernels themselves took
    floor = analyze_trace(synthetic_gpu_trace(), unprofiled_step_ms=0.5)
    assert floor.breakdown["overhead"] == 0.0


def test_a_vision_tower_over_40_percent_of_the_step_is_flagged() -> None:
    trace = synthetic_gpu_trace()
    events = trace["traceEvents"]
    gemm = next(e for e in events if e["name"].startswith("sm90_xmma_gemm"))
    gemm["dur"] = 500  # vision: 200-700, of a 1000 us step
    report = analyze_trace(trace)
    # device time: matmul 200-500 and 600-700, attention 500-600, elementwise 850-900:
    # compute 0.55 of the step; the vision module launched 500 of the 600 us of forward
    # kernels, so about 5/6 x 0.55 of the step
    assert report.modules == {
        "vision": pytest.approx(5 / 6),
        "language_model": pytest.approx(1 / 6),
    }
    (finding,) = [f for f in report.findings if f.kind == "vision_encoder"]
    assert finding.share == pytest.approx(5 / 6 * 0.55, abs=2e-3)
    assert finding.evidence == (
        "the vision tower `vision` takes 83% of forward time, about 46% of the step"
    )


def test_memory_near_the_limit_points_to_the_planner() -> None:
    report = analyze_trace(synthetic_gpu_trace(), memory=(76 * 2**30, 80 * 2**30))
    (finding,) = [f for f in report.findings if f.kind == "memory"]
    assert finding.share == pytest.approx(0.95)
    assert "speedkit plan" in finding.fix
    assert "memory" not in analyze_trace(synthetic_gpu_trace(), memory=(1, 80)).kinds


# Kernel names as an H100 trace of the example VLM records them (torch 2.11, bf16).
_KERNELS = {
    "void at::native::vectorized_elementwise_kernel<4, "
    "at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >(int, "
    "at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)":
        "vectorized_elementwise_kernel<CUDAFunctor_add<float>>",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at:"
    ":TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() "
    "const::{lambda(float)#1}, std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, "
    "unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
    "at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, at:"
    ":native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()("
    ") const::{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, "
    "2ul>, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned "
    "int>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1>)":
        "unrolled_elementwise_kernel<direct_copy_kernel_cuda>",
    "void at::native::elementwise_kernel<128, 4, "
    "at::native::gpu_kernel_impl_nocast<at::native::(anonymous "
    "namespace)::masked_fill_kernel(at::TensorIterator&, c10::Scalar "
    "const&)::{lambda()#1}::operator()() const::{lambda()#12}::operator()() "
    "const::{lambda(c10::BFloat16, bool)#1}>(at::TensorIteratorBase&, "
    "at::native::(anonymous namespace)::masked_fill_kernel(at::TensorIterator&, "
    "c10::Scalar const&)::{lambda()#1}::operator()() const::{lambda()#12}::operator()() "
    "const::{lambda(c10::BFloat16, bool)#1} const&)::{lambda(int)#1}>(int, "
    "at::native::gpu_kernel_impl_nocast<at::native::(anonymous "
    "namespace)::masked_fill_kernel(at::TensorIterator&, c10::Scalar "
    "const&)::{lambda()#1}::operator()() const::{lambda()#12}::operator()() "
    "const::{lambda(c10::BFloat16, bool)#1}>(at::TensorIteratorBase&, "
    "at::native::(anonymous namespace)::masked_fill_kernel(at::TensorIterator&, "
    "c10::Scalar const&)::{lambda()#1}::operator()() const::{lambda()#12}::operator()() "
    "const::{lambda(c10::BFloat16, bool)#1} const&)::{lambda(int)#1})":
        "elementwise_kernel<gpu_kernel_impl_nocast<masked_fill_kernel>>",
    "void at::native::(anonymous "
    "namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
    "namespace)::TensorListMetadata<1>, at::native::(anonymous "
    "namespace)::BinaryOpScalarFunctor<float, 1, 1, 0>, std::multiplies<float>, "
    "float>(at::native::(anonymous namespace)::TensorListMetadata<1>, "
    "at::native::(anonymous namespace)::BinaryOpScalarFunctor<float, 1, 1, 0>, "
    "std::multiplies<float>, float)":
        "multi_tensor_apply_kernel<BinaryOpScalarFunctor<float>, multiplies<float>, float>",
    "void (anonymous namespace)::softmax_warp_backward<float, float, float, 8, false, "
    "false>(float*, float const*, float const*, int, int, int, bool const*)":
        "softmax_warp_backward<float, float, float>",
    "nvjet_sm90_tst_256x128_64x4_2x4_h_bz_coopA_NNT":
        "nvjet_sm90_tst_256x128_64x4_2x4_h_bz_coopA_NNT",
}  # fmt: skip


@pytest.mark.parametrize("name", list(_KERNELS))
def test_cuda_kernel_names_are_shortened_to_what_they_compute(name: str) -> None:
    assert _short_kernel_name(name) == _KERNELS[name]


def test_a_long_kernel_name_is_cut_to_the_limit() -> None:
    name = "flash_fwd_kernel<" + ", ".join(f"Traits{i}<bfloat16_t>" for i in range(20)) + ">"
    short = _short_kernel_name(name, limit=60)
    assert len(short) == 60
    assert short.endswith("...")
