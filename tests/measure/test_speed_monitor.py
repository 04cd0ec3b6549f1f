from __future__ import annotations

import collections
import dataclasses
import platform
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_speedkit import SpeedkitConfigError, SpeedMonitor
from lightning_speedkit.measure import _clock, _cpu_bf16, _flop_book
from lightning_speedkit.measure import speed_monitor as sm
from lightning_speedkit.measure._batch_info import BatchInfo as _BatchInfo
from lightning_speedkit.measure._flop_book import Counted as _Counted
from lightning_speedkit.measure._flop_book import FlopBook as _FlopBook
from lightning_speedkit.measure.speed_monitor import SUMMARY_KEYS
from tests.helpers.clock import VirtualClock

from ..helpers import models
from ..helpers.models import MLP, SlowDataset, loader
from ..helpers.multiprocess import run_script
from ..helpers.recorder import Recorder


def _describe(monitor: SpeedMonitor, batch: Any) -> _BatchInfo:
    """What the monitor reads of one loader's batch."""
    return monitor._reader.read(batch, [batch])


def _fit(model: L.LightningModule, monitor: SpeedMonitor, steps: int, **loader_kw: Any) -> Recorder:
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=steps, logger=recorder, callbacks=[monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=5,
    )  # fmt: skip
    trainer.fit(model, loader(**loader_kw))
    return recorder


def test_logs_every_figure_with_the_speed_prefix() -> None:
    recorder = _fit(MLP(), SpeedMonitor(peak_flops=1e12), steps=20, n=160)
    steps = [step for step, _ in recorder.rows]
    assert steps[:3] == [4, 9, 14]  # where Lightning writes its rows (`self.log`'s)
    _, last = recorder.rows[-1]
    expected = {
        "samples_per_sec",
        "tflops_per_device",
        "mfu",
        "hfu",
        "step_ms_p50",
        "step_ms_p90",
        "step_ms_p99",
        "data_wait_frac",
        "mem_peak_gib",
    }
    assert {k.removeprefix("speed/") for k in last} == expected  # no tokens: float batches
    assert all(k.startswith("speed/") for k in last)
    assert last["speed/step_ms_p50"] <= last["speed/step_ms_p90"] <= last["speed/step_ms_p99"]


def test_flops_are_counted_on_a_real_step_and_match_the_formula() -> None:
    model, monitor = MLP(dim=32, hidden=64), SpeedMonitor(peak_flops=1e12)
    _fit(model, monitor, steps=12)
    summary = monitor.summary
    assert summary["flops_per_sample"] == model.flops_per_sample()
    assert len(monitor.flops.counted) == 1  # one batch shape, counted once
    assert summary["mfu"] == pytest.approx(summary["tflops_per_device"] * 1e12 / 1e12)


def test_step_time_and_throughput_are_measured() -> None:
    monitor = SpeedMonitor(peak_flops=None)
    _fit(MLP(step_delay=0.02), monitor, steps=25, batch_size=8, n=400)
    s = monitor.summary
    # The one real-clock check (the exact arithmetic is tested on a virtual clock below):
    # a 20 ms sleep per step bounds both figures, however busy the machine.
    assert s["step_ms_p50"] is not None
    assert s["step_ms_p50"] >= 20
    assert 0 < s["samples_per_sec"] <= 8 / 0.020
    assert s["mfu"] is None
    assert s["hfu"] is None
    assert set(s) == set(SUMMARY_KEYS)


@pytest.fixture
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    clock = VirtualClock()
    monkeypatch.setattr(_clock, "_host_time", clock)
    monkeypatch.setattr(models, "_sleep", clock.sleep)
    return clock


def test_step_time_throughput_and_data_wait_are_exact(virtual_clock: VirtualClock) -> None:
    # a 2 ms step and four 20 ms reads per batch: 82 ms a step, 80 of them waiting
    monitor = SpeedMonitor(peak_flops=None)
    _fit(MLP(step_delay=0.002), monitor, steps=16, batch_size=4, delay=0.02)
    s = monitor.summary
    assert s["step_ms_p50"] == pytest.approx(82.0, abs=1e-9)
    assert s["step_ms_p90"] == s["step_ms_p99"] == pytest.approx(82.0, abs=1e-9)
    assert s["data_wait_frac"] == pytest.approx(80 / 82, abs=1e-12)
    assert s["samples_per_sec"] == pytest.approx(4 / 0.082, rel=1e-12)


def test_a_fast_loader_waits_nothing(virtual_clock: VirtualClock) -> None:
    monitor = SpeedMonitor(peak_flops=None)
    _fit(MLP(step_delay=0.02), monitor, steps=16, batch_size=8)
    s = monitor.summary
    assert s["step_ms_p50"] == pytest.approx(20.0, abs=1e-9)
    assert s["data_wait_frac"] == 0.0
    assert s["samples_per_sec"] == pytest.approx(400.0, rel=1e-12)


def test_unknown_peak_warns_once_and_leaves_mfu_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sm._peak, "peak_flops", lambda *a, **k: None)
    monitor = SpeedMonitor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorder = _fit(MLP(), monitor, steps=15)
        _fit(MLP(), monitor, steps=15)  # a second fit: still one warning
    messages = [str(w.message) for w in caught if "no peak FLOP/s" in str(w.message)]
    assert len(messages) == 1
    assert "peak_flops=" in messages[0]
    assert all("speed/mfu" not in row for _, row in recorder.rows)
    assert monitor.summary["mfu"] is None
    assert monitor.summary["tflops_per_device"]  # FLOPs are still known


def test_user_flops_override_is_used_and_checked() -> None:
    monitor = SpeedMonitor(flops_per_batch=lambda batch: 1000 * len(batch), peak_flops=1e9)
    _fit(MLP(), monitor, steps=10)
    assert monitor.summary["flops_per_sample"] == 1000
    assert not monitor.flops.counted  # nothing counted when the user says

    bad = SpeedMonitor(flops_per_batch=lambda batch: "lots")
    with pytest.raises(
        SpeedkitConfigError, match=r"`flops_per_batch` must return a finite number.*'lots'"
    ):
        _fit(MLP(), bad, steps=5)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"log_every_n_steps": 0}, "log_every_n_steps"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"peak_flops": "fast"}, "peak_flops"),
        ({"peak_flops": -3.0}, "peak_flops"),
        ({"tokens_per_batch": 128}, "tokens_per_batch"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(SpeedkitConfigError, match=f"`{argument}`"):
        SpeedMonitor(**kwargs)


def test_tokens_come_from_integer_batches_or_the_override() -> None:
    monitor = SpeedMonitor()
    batch = {"images": torch.zeros(4, 3, 8, 8), "input_ids": torch.zeros(4, 17, dtype=torch.long)}
    assert _describe(monitor, batch) == _BatchInfo(_describe(monitor, batch).signature, 4, 68)
    counted = SpeedMonitor(tokens_per_batch=lambda b: int((b["input_ids"] > 0).sum()))
    batch["input_ids"][:, :5] = 1
    assert _describe(counted, batch).tokens == 20


def test_unseen_shapes_are_estimated_by_a_linear_fit_in_tokens() -> None:
    book = _FlopBook()
    for tokens in (40, 80):  # FLOPs = 1000 + 10 * tokens, both totals
        book.counted[str(tokens)] = _Counted(4, tokens, 1000 + 10 * tokens, 1000 + 10 * tokens)
    assert book.estimate(_BatchInfo((), 4, 60)) == (1600.0, 1600.0)
    assert book.estimate(_BatchInfo((), 8, None)) == (2800.0, 2800.0)  # nearest, by samples


def test_variable_shapes_are_counted_up_to_the_cap_and_the_rest_estimated() -> None:
    model, monitor = MLP(), SpeedMonitor(max_flop_counts=2, peak_flops=None)
    sizes = [2, 3, 5, 8] * 4  # four batch shapes, repeated
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    batches = [list(range(s, s + n)) for s, n in zip(starts, sizes, strict=True)]
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=len(batches), logger=recorder, callbacks=[monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=4,
    )  # fmt: skip
    data = SlowDataset(n=sum(sizes))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_sampler=batches))
    assert len(monitor.flops.counted) == 2  # the cap: shapes 3 and 4 are estimated
    # Estimated by scaling with samples, which is exact for this model.
    assert monitor.summary["flops_per_sample"] == pytest.approx(model.flops_per_sample())


def test_resume_continues_the_run_and_reuses_counts(tmp_path: Path) -> None:
    def trainer(steps: int, monitor: SpeedMonitor) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
            enable_model_summary=False, log_every_n_steps=4, default_root_dir=tmp_path,
            callbacks=[monitor, ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        )  # fmt: skip

    first = SpeedMonitor(peak_flops=None)
    trainer(16, first).fit(MLP(), loader(n=64))
    steps_first = sum(r[3] for r in first._throughput.run)
    state = torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"]
    assert any("SpeedMonitor" in key for key in state)

    resumed = SpeedMonitor(peak_flops=None)
    sessions: list[Any] = []
    real = _flop_book.FlopSession

    def counting() -> Any:
        sessions.append(real())
        return sessions[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_flop_book, "FlopSession", counting)
        trainer(32, resumed).fit(MLP(), loader(n=64), ckpt_path=tmp_path / "last.ckpt")
    assert sum(r[3] for r in resumed._throughput.run) > steps_first  # the summary spans both parts
    # One count confirms the checkpoint's (the run may have changed); the same model: kept
    assert len(sessions) == 1
    assert resumed.flops.counted == first.flops.counted
    assert resumed.summary["flops_per_sample"] == first.summary["flops_per_sample"]


def test_a_resumed_run_that_runs_otherwise_drops_the_checkpoints_counts(tmp_path: Path) -> None:
    """Resumed with activation checkpointing added, the checkpoint's counts (no
    recomputation) priced every step: HFU stayed what it was. A new user's run logged
    1.0 where a fresh run with the checkpointing logged 1.3."""
    from lightning_speedkit import ActivationCheckpointing

    def trainer(steps: int, *callbacks: Any) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path,
            callbacks=[*callbacks, ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        )  # fmt: skip

    first = SpeedMonitor(peak_flops=None, warmup_steps=0)
    trainer(4, first).fit(MLP(), loader(n=64))
    resumed = SpeedMonitor(peak_flops=None, warmup_steps=0)
    checkpointing = ActivationCheckpointing(blocks=[nn.Sequential], verbose=False)
    trainer(8, resumed, checkpointing).fit(MLP(), loader(n=64), ckpt_path=tmp_path / "last.ckpt")
    fresh = SpeedMonitor(peak_flops=None, warmup_steps=0)
    trainer(4, fresh, ActivationCheckpointing(blocks=[nn.Sequential], verbose=False)).fit(
        MLP(), loader(n=64)
    )
    (before,), (after,), (alone,) = (m.flops.counted.values() for m in (first, resumed, fresh))
    assert after == alone  # the recomputation counted, as a fresh run counts it
    assert after.hardware > before.hardware
    assert after.model == before.model


@pytest.mark.multiprocess
def test_ddp_sums_throughput_over_ranks_and_reports_stragglers(tmp_path: Path) -> None:
    ranks = run_script("speed_monitor_ddp.py", tmp_path)
    a, b = (r["summary"] for r in ranks)
    assert a["samples_per_sec"] == pytest.approx(b["samples_per_sec"])  # both see the global figure
    per_rank = 8 / (a["step_ms_p50"] / 1e3)
    assert a["samples_per_sec"] == pytest.approx(2 * per_rank, rel=0.3)
    # rank 1's 0.12 s of compute a step against rank 0's 0.02 s: 0.12 / 0.07 over the median.
    # Its step time says nothing: the all-reduce makes rank 0 wait, so both step alike.
    assert a["straggler_ratio"] == b["straggler_ratio"] > 1.5
    assert ranks[0]["logged_keys"]
    assert "speed/straggler_ratio" in ranks[0]["logged_keys"]


@pytest.mark.gpu
def test_hooks_never_synchronise_the_device() -> None:
    model, monitor = MLP().cuda(), SpeedMonitor()

    class SyncGuard(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            torch.cuda.set_sync_debug_mode("error")

        def on_train_batch_end(self, *args: Any) -> None:
            torch.cuda.set_sync_debug_mode("default")

    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_steps=12, logger=False, log_every_n_steps=100,
        callbacks=[SyncGuard(), monitor], enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(model, loader(n=128))
    assert monitor.summary["step_ms_p50"] is not None


def test_gpu_util_is_read_from_nvml_by_device_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: a stand-in NVML checks the lookup (by UUID, as CUDA_VISIBLE_DEVICES
    renumbers devices for torch only) and the scale (percent -> fraction)."""
    import sys
    import types

    calls: list[str] = []
    fake = types.ModuleType("pynvml")
    fake.NVMLError = RuntimeError  # type: ignore[attr-defined]
    fake.nvmlInit = lambda: None  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByUUID = lambda uuid: calls.append(uuid) or "handle"  # type: ignore[attr-defined]
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(sm, "NVML_AVAILABLE", True)
    props = types.SimpleNamespace(uuid="1234-abcd")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert sm._gpu_util(torch.device("cuda", 1)) == pytest.approx(0.87)
    assert calls == ["GPU-1234-abcd"]
    assert sm._gpu_util(torch.device("cpu")) is None


# -- batches of every container a user's collate returns --------------------------------------


@dataclasses.dataclass
class _DataclassBatch:
    note: str
    x: torch.Tensor


def _batch_encoding(x: torch.Tensor) -> Any:
    from transformers import BatchEncoding  # what Hugging Face's collators return

    return BatchEncoding({"x": x})


_CONTAINERS: dict[str, tuple[Any, Any]] = {
    "BatchEncoding": (_batch_encoding, lambda b: b["x"]),
    "UserDict": (lambda x: collections.UserDict(x=x), lambda b: b["x"]),
    "dataclass": (lambda x: _DataclassBatch("meta", x), lambda b: b.x),
    "namedtuple": (lambda x: _Pair(x.shape[0], x), lambda b: b.x),
}
_Pair = collections.namedtuple("_Pair", ["n", "x"])


@pytest.mark.parametrize("container", sorted(_CONTAINERS))
def test_samples_are_found_in_mappings_dataclasses_and_named_tuples(container: str) -> None:
    wrap, unwrap = _CONTAINERS[container]

    class Model(MLP):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step(unwrap(batch), batch_idx)

    model, monitor = Model(dim=32, hidden=64), SpeedMonitor(peak_flops=1e12)
    assert _describe(monitor, wrap(torch.zeros(8, 32))).samples == 8
    trainer = L.Trainer(accelerator="cpu", max_steps=6, logger=False, callbacks=[monitor],
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    data = torch.utils.data.DataLoader(SlowDataset(64, 32), batch_size=8,
                                       collate_fn=lambda rows: wrap(torch.stack(rows)))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # and no "cannot tell" warning
        warnings.filterwarnings("ignore", message=".*(workers|log_every_n_steps|smaller).*")
        trainer.fit(model, data)
    # FLOPs per sample exact: the batch really counted 8 samples, not 1
    assert monitor.summary["flops_per_sample"] == model.flops_per_sample()


def test_a_batch_without_a_sample_count_is_said_once_naming_the_override() -> None:
    monitor = SpeedMonitor()
    with pytest.warns(UserWarning, match="samples_per_batch=") as record:
        counts = [_describe(monitor, b).samples for b in ({"ids": [1, 2, 3]}, torch.tensor(3.0))]
    assert counts == [1, 1]
    assert len(record) == 1
    assert "`dict`" in str(record[0].message)
    assert _describe(SpeedMonitor(samples_per_batch=lambda b: 3), {"a": [1]}).samples == 3


# --- bf16 on a CPU without native bf16 ---------------------------------------------------------


def _bf16_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "native bf16" in str(w.message)]


def _fit_in(precision: str, monitor: SpeedMonitor, steps: int = 12) -> None:
    trainer = L.Trainer(
        accelerator="cpu", precision=precision, max_steps=steps, logger=False, callbacks=[monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(MLP(), loader(n=8 * steps))


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_on_a_cpu_without_native_bf16_warns_once_with_the_fix(
    precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cpu_bf16, "cpu_native_bf16", lambda: False)
    monitor = SpeedMonitor(peak_flops=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit_in(precision, monitor)
        _fit_in(precision, monitor)  # 24 steps over two fits: still one warning
    assert _bf16_warnings(caught) == [
        f"SpeedMonitor: this run trains in {precision} on a CPU without native bf16 "
        "instructions (no AVX512_BF16 or AMX_BF16), where bf16 is emulated and slower than "
        "float32: on such a CPU (2 AVX2 cores), a training step of the kit's tiny example VLM "
        "took 312 ms in bf16 autocast against 41 ms in float32, 8x slower "
        "(benchmarks/cpu_step.py). Train in float32 on this CPU: `Trainer(precision='32-true')`."
    ]


@pytest.mark.parametrize(
    ("precision", "native"),
    [
        pytest.param("bf16-mixed", True, id="native-bf16"),
        pytest.param("bf16-mixed", None, id="cannot-tell"),
        pytest.param("32-true", False, id="float32"),
    ],
)
def test_no_bf16_warning_with_native_bf16_unknown_support_or_float32(
    precision: str, native: bool | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_cpu_bf16, "cpu_native_bf16", lambda: native)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit_in(precision, SpeedMonitor(peak_flops=None))
    assert _bf16_warnings(caught) == []


@pytest.mark.parametrize(("device", "warned"), [("cpu", 1), ("cuda", 0)])
def test_no_bf16_warning_on_cuda(device: str, warned: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same fit start on a CPU (it warns: the stand-in trainer reaches the check) and
    on a GPU, where bf16 is native and the CPU's instructions do not matter."""
    monkeypatch.setattr(_cpu_bf16, "cpu_native_bf16", lambda: False)
    trainer: Any = types.SimpleNamespace(
        strategy=types.SimpleNamespace(root_device=torch.device(device)), precision="bf16-mixed"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SpeedMonitor(peak_flops=None).on_fit_start(trainer, MLP())
    assert len(_bf16_warnings(caught)) == warned


_NO_BF16 = {"architecture": "x86_64", "avx2": True, "avx512_bf16": False, "amx_bf16": False}


@pytest.mark.parametrize(
    ("system", "capabilities", "native"),
    [
        pytest.param("linux", _NO_BF16, False, id="avx2-only"),
        pytest.param("linux", {**_NO_BF16, "avx512_bf16": True}, True, id="avx512-bf16"),
        pytest.param("linux", {**_NO_BF16, "amx_bf16": True}, True, id="amx-bf16"),
        pytest.param("darwin", _NO_BF16, None, id="not-linux"),
        pytest.param("linux", {**_NO_BF16, "architecture": "aarch64"}, None, id="not-x86"),
        pytest.param("linux", {"architecture": "x86_64", "avx2": True}, None, id="flags-unnamed"),
        pytest.param("linux", None, None, id="no-query"),
    ],
)
def test_native_bf16_is_read_from_torch_capabilities(
    system: str, capabilities: dict[str, Any] | None, native: bool | None
) -> None:
    assert _cpu_bf16.native_bf16(system, capabilities) is native


def test_this_machine_native_bf16_agrees_with_proc_cpuinfo() -> None:
    """torch's answer for this machine against the kernel's CPU flags."""
    cpuinfo = Path("/proc/cpuinfo")
    linux_x86 = sys.platform.startswith("linux") and platform.machine() == "x86_64"
    if not linux_x86 or not cpuinfo.exists():
        pytest.skip("the flags are read from /proc/cpuinfo on Linux x86-64")
    flags = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    assert _cpu_bf16.cpu_native_bf16() is bool(flags & {"avx512_bf16", "amx_bf16"})


_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx2 {extra}
bugs\t\t: sysret_ss_attrs
"""


@pytest.mark.parametrize(
    ("extra", "native"), [("", False), ("avx512f avx512_bf16", True), ("amx_bf16 amx_tile", True)]
)
def test_without_torchs_capabilities_the_flags_come_from_proc_cpuinfo(
    extra: str, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch without ``torch.cpu.get_capabilities`` (older ones): /proc/cpuinfo's flags."""
    capabilities = _cpu_bf16.cpuinfo_capabilities(_CPUINFO.format(extra=extra), "x86_64")
    assert _cpu_bf16.native_bf16("linux", capabilities) is native
    assert (
        _cpu_bf16.native_bf16("linux", _cpu_bf16.cpuinfo_capabilities(_CPUINFO, "aarch64")) is None
    )
    assert _cpu_bf16.cpuinfo_capabilities("processor\t: 0\n", "x86_64") is None
    # and on this machine, with torch's query gone, the same answer as with it
    if sys.platform.startswith("linux") and Path("/proc/cpuinfo").exists():
        with_query = _cpu_bf16.cpu_native_bf16()
        monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
        assert _cpu_bf16.cpu_native_bf16() is with_query


class _StopsEpochOnTheLastBatch(MLP):
    """Ends each epoch (Lightning's -1 from ``on_train_batch_start``) on its 4th batch."""

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> int | None:
        return -1 if batch_idx == 3 else None


def test_a_batch_the_module_skips_leaves_no_flop_count_running() -> None:
    hooks = torch.nn.modules.module._global_forward_hooks
    hooks_before = len(hooks)
    monitor = SpeedMonitor(log_every_n_steps=1, peak_flops=None)
    model = _StopsEpochOnTheLastBatch()
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=2, logger=False, callbacks=[monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        # 3 batches of 8, then one of 5: a new shape, so its count opens and is cut off
        trainer.fit(model, loader(n=29))
        assert torch._C._len_torch_dispatch_stack() == 0  # was 1: a FLOP counter, forever
        assert len(hooks) == hooks_before
    finally:
        while torch._C._len_torch_dispatch_stack():  # keep a failure from slowing the rest
            torch._C._pop_torch_dispatch_stack(None)
    # the cut-off batch recorded nothing; the full batches' count is exact
    assert [(c.samples, c.model) for c in monitor.flops.counted.values()] == [
        (8, 8 * model.flops_per_sample())
    ]
    assert monitor.summary["flops_per_sample"] == model.flops_per_sample()


def test_the_cuda_memory_peak_is_this_fits_own(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three fits in one process on an H200 all reported the first one's peak, 15.19 GiB.
    resets: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    for batch in (1, 2, 3):
        sm._reset_memory_peak(torch.device("cuda", 1), batch)
    sm._reset_memory_peak(torch.device("cpu"), 1)
    assert resets == [torch.device("cuda", 1)]


@pytest.mark.gpu
def test_a_second_fit_reports_its_own_cuda_memory_peak() -> None:
    big = torch.empty(2**28, device="cuda")  # 1 GiB held before the second fit
    del big
    monitor = SpeedMonitor(warmup_steps=0, log_every_n_steps=2)
    trainer = L.Trainer(
        accelerator="gpu", devices=1, max_steps=4, logger=False, callbacks=[monitor],
        enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(MLP().cuda(), loader(n=64))
    assert monitor.summary["mem_peak_gib"] is not None
    assert monitor.summary["mem_peak_gib"] < 0.5  # the MLP's, not the 1 GiB before it


class _LoggingMLP(MLP):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize("accumulate", [1, 2])
def test_its_rows_are_lightnings_rows_at_the_trainers_cadence(accumulate: int) -> None:
    """A new user's CSV had `train_loss` at steps 2, 5, 8 and `speed/*` at 3, 6, 9: every
    row split in two. Under accumulation `speed/*` came twice as often, irregularly."""
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=12, logger=recorder, log_every_n_steps=3,
        accumulate_grad_batches=accumulate, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        callbacks=[SpeedMonitor(peak_flops=None, warmup_steps=0)],
    )  # fmt: skip
    trainer.fit(_LoggingMLP(), loader(n=12 * 8 * accumulate))
    loss_steps = [step for step, row in recorder.rows if "train_loss" in row]
    speed_steps = [step for step, row in recorder.rows if "speed/samples_per_sec" in row]
    assert sorted(set(loss_steps)) == [2, 5, 8, 11]
    assert speed_steps == [2, 5, 8, 11], speed_steps


def test_fits_in_one_process_divide_by_the_peak_timed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU's peak is a timed matmul: timed anew per fit, it moved 2x between fits on a
    busy machine, and the MFU of two runs could not be compared. `"auto"` and `"measure"`
    time the same matmul on a CPU: one timing serves both."""
    timed = iter([4e10, 9e10])
    monkeypatch.setattr(sm._peak, "measure_matmul_peak", lambda device, dtype: next(timed))
    monitors = [SpeedMonitor(peak_flops="auto"), SpeedMonitor(), SpeedMonitor(peak_flops="measure")]
    for monitor in monitors:
        _fit(MLP(), monitor, steps=6)
        summary = monitor.summary
        assert summary["mfu"] == pytest.approx(summary["tflops_per_device"] * 1e12 / 4e10)
    assert next(timed) == 9e10  # timed once
